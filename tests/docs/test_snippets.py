"""Every Python block of README.md and docs/ that a user would copy runs, on the CPU with two
gloo ranks started as torchrun starts them (tests/support/snippet_rank.py: the names a guide
assumes defined, and the GPU lines put on the CPU by its ``ON_CPU`` table, nothing else).

A block right after ``<!-- given: CODE -->`` runs after CODE: what its section assumes of the
script around it (a wrapper built with ``shard_optimizer_state``, a checkpoint path). The
Lightning and Accelerate guides' blocks run too, inside the two processes already started
(as under torchrun), with the example's classes. Signatures that are not code to copy are
``text`` blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dist_harness import _free_port

import leanddp

ROOT = Path(__file__).resolve().parents[2]
RANK = ROOT / "tests" / "support" / "snippet_rank.py"
# the ranks import the leanddp this test imported (installed, or PYTHONPATH=python)
PACKAGE_ROOT = str(Path(leanddp.__file__).resolve().parents[1])
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GIVEN = "<!-- given: "
_BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.S | re.M)

#: a guide's class, and the framework its snippet needs
FRAMEWORKS = [("LeanDDPStrategy", "lightning"), ("LeanDDPAccelerator", "accelerate")]

pytestmark = pytest.mark.docs


def _given(text: str, block: int) -> str:
    """The code of a ``<!-- given: CODE -->`` right before the block starting at ``block``."""
    start = text.rfind(GIVEN, 0, block)
    end = text.find("-->", start) if start >= 0 else -1
    if end < 0 or text[end + 3 : block].strip():
        return ""  # (none, or not right before this block)
    return text[start + len(GIVEN) : end].strip() + "\n"


def _blocks() -> list[pytest.param]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):  # (a block in a list item is indented)
            line = text[: m.start(2)].count("\n") + 1
            where = f"{page.relative_to(ROOT)}:{line}"
            source = _given(text, m.start()) + textwrap.dedent(m.group(2))
            found.append(pytest.param(source, id=where))
    return found


BLOCKS = _blocks()


def test_the_pages_have_snippets() -> None:
    """(The pattern finds the blocks: the README's and the guides'.)"""
    pages = {block.id.split(":")[0] for block in BLOCKS}
    assert {"README.md", "docs/getting-started.md", "docs/ddp.md"} <= pages, pages


@pytest.mark.parametrize("source", BLOCKS)
def test_snippet_runs(source: str, tmp_path: Path) -> None:
    for framework, module in FRAMEWORKS:
        if framework in source:
            pytest.importorskip(module, reason=f"the README's test command installs {module}")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(source)
    port = str(_free_port())
    ranks = []
    for rank in range(2):
        env = dict(  # what torchrun sets
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
            WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ROLE_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, TORCHELASTIC_RUN_ID="snippet",
            PYTHONPATH=os.pathsep.join([str(ROOT / "examples"), PACKAGE_ROOT]),
        )  # fmt: skip
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(RANK), str(snippet)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,  # (what a snippet writes: Lightning's checkpoints)
            )  # fmt: skip
        )
    outputs = []
    for p in ranks:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            raise
        outputs.append((p.returncode, out))
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{out[-4000:]}"

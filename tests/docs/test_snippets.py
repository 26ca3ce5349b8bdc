"""Every Python block of README.md and docs/ that a user would copy runs, on the CPU with two
gloo ranks that have torchrun's environment (tests/support/snippet_rank.py: the names a guide
assumes defined, and the GPU lines put on the CPU by its ``ON_CPU`` table, nothing else). The
ranks are forked from the fork server of dist_harness.py, which has imported torch and leanddp
once, rather than started as fresh interpreters that import them again (about 7 s of CPU per
rank on the 2-core CI machine).

A block right after ``<!-- given: CODE -->`` runs after CODE: what its section assumes of the
script around it (a wrapper built with ``shard_optimizer_state``, a checkpoint path). The
Lightning and Accelerate guides' blocks run too, inside the two processes already started
(as under torchrun), with the example's classes. Signatures that are not code to copy are
``text`` blocks.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import snippet_rank
from dist_harness import START_METHOD, _free_port, run_processes

ROOT = Path(__file__).resolve().parents[2]
#: seconds both ranks of a snippet may take (a Lightning run on a busy 2-core machine: about 20)
RANK_TIMEOUT_S = 180
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
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    try:
        run_processes(
            2, _rank, (_free_port(), str(snippet)), RANK_TIMEOUT_S, "the snippet's ranks",
            START_METHOD, "RANK_TIMEOUT_S",
        )  # fmt: skip
    except Exception as e:  # (a rank raised, exited non-zero or ran past the deadline)
        out = "".join(
            f"--- rank {r} ---\n{log.read_text()[-4000:] if log.exists() else ''}"
            for r, log in enumerate(logs)
        )
        raise AssertionError(f"{e}\n{out}") from e


def _rank(rank: int, port: int, snippet: str) -> None:
    """One rank, in a process forked from the server: torchrun's environment, the snippet's
    folder as the working directory (what a snippet writes: Lightning's checkpoints), the
    examples on the path (the guides' classes), and its output in ``rank{rank}.log`` there."""
    os.environ.update(  # what torchrun sets
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ROLE_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="snippet",
    )  # fmt: skip
    os.chdir(Path(snippet).parent)
    sys.path.insert(0, str(ROOT / "examples"))
    with open(f"rank{rank}.log", "w") as out:  # (the process's descriptors: C++ writes there)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    snippet_rank.main(snippet)

"""The API reference (docs/, Sphinx with autodoc and napoleon) builds with warnings as errors:
a broken cross-reference, a page outside the table of contents or an undocumented public
argument (docs/_ext/leanddp_docs.py) fails. Needs the pinned ``sphinx``, ``myst-parser`` and
``sphinx-argparse`` of the README's test command."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import leanddp

pytest.importorskip("sphinx", reason="the API reference needs sphinx (README's test command)")
pytest.importorskip("myst_parser", reason="the guides need myst-parser (README's test command)")
pytest.importorskip("sphinxarg", reason="the command lines need sphinx-argparse")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.docs


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-n", "-E", "-q", "-b", "html", str(source),
         str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_reference_builds_clean_and_lists_every_argument(tmp_path: Path) -> None:
    done = _build(DOCS, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    page = (tmp_path / "api" / "ddp.html").read_text()
    arguments = inspect.signature(leanddp.DistributedDataParallel.__init__).parameters
    for name in arguments:
        if name != "self":
            assert f"<strong>{name}</strong>" in page, f"{name} is missing from the reference"
    cli = (tmp_path / "api" / "cli.html").read_text()
    for option in ("--world-sizes", "--gpu-memory-gb"):  # the bench's and the planner's
        assert option in cli, option
    for guide in ("getting-started", "memory", "reliability", "architecture", "lightning"):
        assert (tmp_path / f"{guide}.html").exists(), guide


def test_an_undocumented_argument_fails_the_build(tmp_path: Path) -> None:
    """The check of docs/_ext/leanddp_docs.py, on a project of one function whose docstring
    forgets one of its two arguments."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "sample.py").write_text(
        textwrap.dedent('''
        def step(lr: float, momentum: float) -> None:
            """One step.

            Args:
                lr: the learning rate.
            """
        ''')
    )
    (source / "conf.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(source)!r}, {str(DOCS / "_ext")!r}]
        extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "leanddp_docs"]
        """)
    )
    (source / "index.rst").write_text("Sample\n======\n\n.. autofunction:: sample.step\n")
    done = _build(source, tmp_path / "out")
    assert done.returncode != 0
    assert "sample.step: argument 'momentum' is not documented" in done.stderr, done.stderr
    assert "'lr'" not in done.stderr

"""Sphinx configuration of leanddp's documentation: the API reference, generated from the
docstrings (autodoc + napoleon), and the hand-written guides (Markdown, through MyST).

Build it with ``sphinx-build -W -n -b html docs docs/_build/html`` (warnings are errors:
a broken cross-reference or an undocumented public argument fails; tests/docs/test_docs.py runs
exactly that). Needs leanddp importable (built) and ``sphinx``, ``myst-parser`` and
``sphinx-argparse`` at the versions the README's test command pins.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import leanddp  # noqa: E402  (the reference documents what is installed)

project = "leanddp"
release = version = leanddp.__version__
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "sphinxarg.ext",
    "leanddp_docs",  # every public argument documented; links to files outside docs/
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = True
# Types from other projects appear in signatures; without their inventories (no network in CI)
# they cannot be linked, which is not a broken reference of ours.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|argparse|numpy|dist|nn|Tensor)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Sequence|Iterable|Iterator|Mapping|Self|Path|optional)"),
    (r"py:.*", r"(int|float|str|bool|dict|list|tuple|None|object|type)"),
    (r"py:.*", r"leanddp\._\w+\..*"),  # private types in public signatures
    (r"py:class", r"_C\.\w+|DDPLogger"),  # the wrapper's reducer and logger, as ddp.py names them
]
html_theme = "alabaster"
html_static_path: list[str] = []

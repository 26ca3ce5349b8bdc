"""A Sphinx extension of leanddp's docs.

- Every public argument is documented: autodoc hands each docstring it renders to
  ``autodoc-process-docstring``; after napoleon has turned Google-style ``Args:`` into
  ``:param name:`` fields, each parameter of the signature (a class's ``__init__``) must have
  one, or a dataclass field its attribute docstring; otherwise a warning names it (``-W``
  makes that an error).
- Attribute docstrings are left as written: napoleon would read "text: more" on their first
  line as "type: description".
- A Markdown link to a file of the repository outside ``docs/`` (``../benchmarks/RESULTS.md``)
  stays a link to that path, where the file exists; one to a missing file still warns.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)
_PARAM = re.compile(r":param\s+(?:[^:]*\s)?\**(\w+):")
_ATTRIBUTES: dict[str, list[str]] = {}


def _attribute_docs(cls: type) -> set[str]:
    try:
        docs = ModuleAnalyzer.for_module(cls.__module__).find_attr_docs()
    except Exception:  # noqa: BLE001 (no source: nothing documented that way)
        return set()
    return {attr for (owner, attr) in docs if owner == cls.__qualname__}


def check_arguments(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Warns for each argument of ``obj``'s signature that ``lines`` do not document."""
    if what not in ("function", "method", "class") or not callable(obj):
        return
    if what == "class" and obj.__init__ is object.__init__:
        return
    try:
        signature = inspect.signature(obj.__init__ if what == "class" else obj)
    except (TypeError, ValueError):
        return
    documented = {m.group(1) for line in lines for m in _PARAM.finditer(line)}
    if what == "class" and dataclasses.is_dataclass(obj):
        documented |= _attribute_docs(obj)
    for param in signature.parameters.values():
        if param.name in ("self", "cls") or param.name in documented:
            continue
        logger.warning(
            "%s: argument %r is not documented (add it to the docstring's Args:)",
            name, param.name, type="leanddp", subtype="undocumented-argument",
        )  # fmt: skip


def _keep_attribute(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]):
    if what in ("attribute", "data"):
        _ATTRIBUTES[name] = list(lines)


def _restore_attribute(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what in ("attribute", "data") and name in _ATTRIBUTES:
        lines[:] = _ATTRIBUTES.pop(name)


def link_repository_files(app: Sphinx, doctree: nodes.document) -> None:
    """A Markdown link to an existing file outside docs/ becomes a plain relative link."""
    source_dir = Path(app.srcdir).resolve()
    depth = len(Path(app.env.docname).parent.parts)  # (the page's folder, within docs/)
    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
            continue
        path = (source_dir / node["reftarget"]).with_suffix(".md").resolve()
        if source_dir in path.parents or not path.exists():
            continue  # a document of ours, or a broken link: myst resolves or warns
        uri = os.path.join(*[".."] * depth, os.path.relpath(path, source_dir))
        node.replace_self(nodes.reference("", "", *node.children, refuri=uri, internal=False))


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _keep_attribute, priority=100)
    app.connect("autodoc-process-docstring", _restore_attribute, priority=800)
    # after napoleon (priority 500), which turns "Args:" into ":param" fields
    app.connect("autodoc-process-docstring", check_arguments, priority=900)
    app.connect("doctree-read", link_repository_files)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""Loads the compiled extension ``leanddp._C``, or fails at import with how to fix it.

There is no pure-Python fallback: a missing or mismatched extension is an installation error.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ._version import __version__

_REBUILD = (
    "Rebuild leanddp against the installed torch, from the leanddp source tree: "
    "`pip install --no-build-isolation --force-reinstall --no-deps .`"
)


def _load() -> ModuleType:
    try:
        module = importlib.import_module("leanddp._C")
    except ModuleNotFoundError as exc:
        if exc.name != "leanddp._C":
            raise
        raise ImportError(
            "leanddp's compiled extension leanddp._C is missing: leanddp was not built (for "
            f"example, imported from a source checkout that was never installed). {_REBUILD}"
        ) from exc
    except ImportError as exc:  # the .so exists but does not link against this torch
        raise ImportError(
            f"leanddp's compiled extension failed to load ({exc}). It was most likely built for "
            f"another torch than the installed {torch.__version__}. {_REBUILD}"
        ) from exc
    built_for = module.build_info()["torch_version"]
    installed = torch.__version__.split("+")[0]
    if built_for != installed:
        raise ImportError(
            f"leanddp was built for torch {built_for} but torch {torch.__version__} is "
            f"installed. {_REBUILD}"
        )
    compiled = module.build_info().get("version")
    if compiled != __version__:  # a source tree updated without rebuilding its extension
        raise ImportError(
            f"leanddp's compiled extension is from leanddp {compiled}, its Python files from "
            f"{__version__}. {_REBUILD}"
        )
    return module


if TYPE_CHECKING:  # the module _load() returns, as its stub _C.pyi describes it
    from . import _C as _C
else:
    _C = _load()


def build_info() -> dict[str, Any]:
    """How the extension was built: leanddp's ``version`` (``leanddp.__version__``, checked at
    import), the ``torch_version`` it was compiled against, whether it has its ``cuda`` kernels,
    and the ``cpu_isa`` its CPU kernels use on this machine."""
    return dict(_C.build_info())

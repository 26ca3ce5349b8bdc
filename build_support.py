"""Checks setup.py runs before building: is the torch it builds against the one that will run it?

The extension is compiled against torch's C++ ABI, so it must be built with the torch of the
environment it is installed into. ``pip install .`` without ``--no-build-isolation`` builds in
a temporary environment instead: pip's overlay (``pip-build-env-*``, put on ``sys.path`` in
front of the target's site-packages, which it hides), pypa/build's ``build-env-*`` virtual
environment, or uv's ``builds-v0`` one. Whatever torch such an environment holds (if any) is
not the installed one, and an extension built against it fails at ``import leanddp``.
Standard library only: this module runs before torch can be imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

# Directory names that build frontends give their temporary build environments.
_OVERLAY_PREFIXES = ("pip-build-env-",)  # pip: an overlay on sys.path, same interpreter
_VENV_PREFIXES = ("build-env-",)  # pypa/build: a fresh virtual environment
_VENV_PARENTS = ("builds-v0",)  # uv: <cache>/builds-v0/.tmpXXXX


def isolated_build_roots(
    sys_path: Iterable[str], prefix: str, base_prefix: str, environ: Mapping[str, str]
) -> list[Path]:
    """The roots of the temporary build environments this interpreter runs in (empty: none).

    Looks at ``sys.path`` and ``PYTHONPATH`` entries (pip's overlay and its ``site`` directory)
    and at ``sys.prefix`` (a build frontend's virtual environment).
    """
    roots: list[Path] = []
    entries = [*sys_path, *environ.get("PYTHONPATH", "").split(os.pathsep)]
    for entry in entries:
        if not entry:
            continue
        parts = Path(entry).parts
        for i, part in enumerate(parts):
            if part.startswith(_OVERLAY_PREFIXES):
                root = Path(*parts[: i + 1])
                if root not in roots:
                    roots.append(root)
                break
    venv = Path(prefix)
    if prefix != base_prefix and (
        venv.name.startswith(_VENV_PREFIXES) or venv.parent.name in _VENV_PARENTS
    ):
        roots.append(venv)
    return roots


def _is_under(path: str, root: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
    except ValueError:
        return False
    return True


def install_command(python: str, source_dir: str, editable: bool | None) -> str:
    """The command that builds against the installed torch (``editable``: None if unknown)."""
    if editable is None:
        return (
            f"{python} -m pip install --no-build-isolation {source_dir}\n"
            "    (add -e after install for an editable install)"
        )
    editable_flag = " -e" if editable else ""
    return f"{python} -m pip install --no-build-isolation{editable_flag} {source_dir}"


def torch_mismatch(
    build_torch: str | None,
    roots: list[Path],
    target_torch: str | None,
    command: str,
) -> str | None:
    """Why the build must stop, or None when it builds against the right torch.

    ``build_torch``: ``torch.__file__`` of the torch the build imports (None: not importable);
    ``roots``: :func:`isolated_build_roots`; ``target_torch``: where the interpreter that is
    installed into finds torch outside the build environment (None: not installed or
    unknown); ``command``: :func:`install_command`.
    """
    where = (
        f"torch is installed at {Path(target_torch).parent}"
        if target_torch
        else "no torch was found for this Python"
    )
    if build_torch is None:
        if roots:
            cause = (
                f"this build runs in an isolated environment ({roots[0]}), which has no "
                f"torch ({where}). The extension must be compiled against the torch it runs with"
            )
        else:
            cause = f"torch cannot be imported ({where}). Install torch first"
        return f"{cause}. Build with:\n\n    {command}\n"
    isolated = [root for root in roots if _is_under(build_torch, root)]
    if not isolated:
        return None
    return (
        f"this build runs in an isolated environment ({isolated[0]}) against its own "
        f"torch ({Path(build_torch).parent}), not the installed one ({where}): the extension "
        "would fail at `import leanddp`. Build against the installed torch with:\n\n"
        f"    {command}\n"
    )


def target_torch_origin(python: str, roots: list[Path], environ: Mapping[str, str]) -> str | None:
    """Where ``python`` finds torch with the build environment's paths removed (no import)."""
    env = dict(environ)
    path = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not any(_is_under(p, root) for root in roots)
    ]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if not path:
        del env["PYTHONPATH"]
    env.pop("PYTHONNOUSERSITE", None)  # pip's overlay sets it
    code = "import importlib.util as u; s = u.find_spec('torch'); print(s.origin if s else '')"
    try:
        out = subprocess.run(
            [python, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    origin = out.stdout.strip()
    return origin or None


def check_build_torch(source_dir: str, argv: list[str]) -> None:
    """Exits with the right install command when the build would use the wrong torch.

    Imports torch (as the build does); call it before importing anything else from torch.
    """
    roots = isolated_build_roots(sys.path, sys.prefix, sys.base_prefix, os.environ)
    # pip runs the build with the interpreter it installs into; a build frontend's virtual
    # environment (a wheel build, no target) has its own.
    python = sys.executable
    if any(_is_under(python, root) for root in roots):
        python = "python"
    try:
        import torch

        build_torch: str | None = torch.__file__
    except ImportError:
        build_torch = None
    if build_torch is not None and not roots:
        return
    target = target_torch_origin(python, roots, os.environ)
    # setuptools runs "egg_info" to get the build requirements (editable or not: unknown)
    # and "editable_wheel" / "bdist_wheel" to build.
    editable = True if "editable_wheel" in argv else False if "bdist_wheel" in argv else None
    command = install_command(python, source_dir, editable)
    problem = torch_mismatch(build_torch, roots, target, command)
    if problem:
        raise SystemExit(f"\nleanddp: {problem}")

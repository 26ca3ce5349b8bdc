"""The compiled extension: how it reports its build, and how a bad installation fails."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leanddp

OPS = ["flatten_into", "unflatten_from", "adam_step_", "sgd_step_"]
PACKAGE_DIR = Path(leanddp.__file__).parent


def test_build_info_describes_this_build():
    info = leanddp.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["cpu_isa"] in {"avx512vbmi", "avx512", "avx2", "baseline"}
    assert isinstance(info["cuda"], bool)
    if os.environ.get("LEANDDP_EXPECT_CUDA_BUILD") == "1":
        assert info["cuda"], "CI builds the CUDA kernels: this build has none"


@pytest.mark.parametrize("op", OPS)
def test_cuda_kernel_matches_build(op):
    """A CUDA build registers the real kernels; a CPU-only build a stub that says how to fix it."""
    cuda_line = next(
        line
        for line in torch._C._dispatch_dump(f"leanddp::{op}").splitlines()
        if line.startswith("CUDA:")
    )
    if leanddp.build_info()["cuda"]:
        assert "csrc/ops/cuda/" in cuda_line
    else:
        assert "cuda_missing.cpp" in cuda_line


def test_cpu_only_build_raises_how_to_rebuild_on_cuda():
    if leanddp.build_info()["cuda"]:
        pytest.skip("this build has the CUDA kernels; the stub is not registered")
    op = torch.ops.leanddp.flatten_into.default
    cuda_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"built without its CUDA kernels.*LEANDDP_FORCE_CUDA=1"):
        op.redispatch(cuda_keys, [torch.zeros(2)], torch.zeros(2), None)


def _import_in_subprocess(
    pythonpath: Path | None, prelude: str = ""
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    code = f"{prelude}\nimport leanddp"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def _package_copy(tmp_path: Path, extension_bytes: bytes | None) -> Path:
    """leanddp's Python files in tmp_path/leanddp, with no _C or with `extension_bytes` as _C."""
    dst = tmp_path / "leanddp"
    dst.mkdir()
    for py in PACKAGE_DIR.glob("*.py"):
        shutil.copy(py, dst / py.name)
    if extension_bytes is not None:
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        (dst / f"_C{suffix}").write_bytes(extension_bytes)
    return tmp_path


def test_missing_extension_says_how_to_build(tmp_path):
    result = _import_in_subprocess(_package_copy(tmp_path, None))
    assert result.returncode != 0
    assert "ImportError: leanddp's compiled extension leanddp._C is missing" in result.stderr
    assert "pip install --no-build-isolation" in result.stderr


def test_broken_extension_says_how_to_rebuild(tmp_path):
    result = _import_in_subprocess(_package_copy(tmp_path, b"not a shared library"))
    assert result.returncode != 0
    assert "leanddp's compiled extension failed to load" in result.stderr
    assert "pip install --no-build-isolation --force-reinstall" in result.stderr


def test_extension_built_for_another_torch_is_refused():
    result = _import_in_subprocess(None, "import torch; torch.__version__ = '1.0.0'")
    assert result.returncode != 0
    built = leanddp.build_info()["torch_version"]
    assert f"leanddp was built for torch {built} but torch 1.0.0 is installed" in result.stderr


# -- the build refuses a torch other than the installed one (build_support.py, run by setup.py)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import build_support  # noqa: E402


def test_isolated_build_roots_finds_pip_overlay_and_build_venvs():
    overlay = "/tmp/pip-build-env-k2x/overlay/lib/python3.11/site-packages"
    normal = "/tmp/pip-build-env-k2x/normal/lib/python3.11/site-packages"
    roots = build_support.isolated_build_roots(
        ["/usr/lib/python311.zip", overlay, normal], "/venv", "/usr", {}
    )
    assert roots == [Path("/tmp/pip-build-env-k2x")]
    site = {"PYTHONPATH": "/tmp/pip-build-env-q7/site"}  # pip's sitecustomize directory
    assert build_support.isolated_build_roots([], "/venv", "/usr", site) == [
        Path("/tmp/pip-build-env-q7")
    ]
    venvs = ["/tmp/build-env-abc", "/root/.cache/uv/builds-v0/.tmpXyZ"]
    for venv in venvs:  # pypa/build and uv build in their own virtual environments
        assert build_support.isolated_build_roots([], venv, "/usr", {}) == [Path(venv)]
    plain = ["/venv/lib/python3.11/site-packages", "/home/u/pytorch"]
    assert build_support.isolated_build_roots(plain, "/venv", "/usr", {"PYTHONPATH": ""}) == []


def test_torch_mismatch_only_in_an_isolated_environment():
    root = Path("/tmp/pip-build-env-k2x")
    isolated_torch = f"{root}/overlay/lib/python3.11/site-packages/torch/__init__.py"
    target = "/venv/lib/python3.11/site-packages/torch/__init__.py"
    command = build_support.install_command("/venv/bin/python", "/src/leanddp", editable=False)
    assert command == "/venv/bin/python -m pip install --no-build-isolation /src/leanddp"
    assert "-e /src" in build_support.install_command("py", "/src", editable=True)
    # pip put a second torch into its overlay: refused, naming both and the command
    msg = build_support.torch_mismatch(isolated_torch, [root], target, command)
    assert msg is not None and command in msg
    assert f"{root}/overlay" in msg and "/venv/lib/python3.11/site-packages/torch" in msg
    # the isolated environment has no torch (it is not a build requirement)
    msg = build_support.torch_mismatch(None, [root], target, command)
    assert msg is not None and command in msg and "isolated environment" in msg
    # no isolation: the installed torch, wherever it lives (a source checkout too), is used
    assert build_support.torch_mismatch(target, [], target, command) is None
    assert build_support.torch_mismatch("/home/u/pytorch/torch/__init__.py", [], None, "c") is None
    # isolated, but torch comes from outside the build environment
    assert build_support.torch_mismatch(target, [root], target, command) is None
    # no torch at all, no isolation: install torch first
    msg = build_support.torch_mismatch(None, [], None, command)
    assert msg is not None and "Install torch first" in msg and command in msg


def _check_build_torch(extra_sys_path: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """check_build_torch as setup.py runs it, with `extra_sys_path` in front of sys.path."""
    code = (
        f"import sys; sys.path[:0] = {extra_sys_path!r}; sys.path.insert(0, {str(REPO)!r})\n"
        f"import build_support; build_support.check_build_torch('/src/leanddp', {argv!r})\n"
        "import torch; print('built against', torch.__file__)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_check_build_torch_stops_a_build_in_pips_overlay(tmp_path):
    """A torch in a pip-build-env overlay, as pip installs it, stops the build with the command."""
    overlay = tmp_path / "pip-build-env-x1" / "overlay" / "lib" / "python3.11" / "site-packages"
    (overlay / "torch").mkdir(parents=True)
    (overlay / "torch" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    result = _check_build_torch([str(overlay)], ["setup.py", "bdist_wheel"])
    assert result.returncode == 1, result.stdout + result.stderr
    expected = f"{sys.executable} -m pip install --no-build-isolation /src/leanddp"
    assert expected in result.stderr
    assert str(overlay / "torch") in result.stderr
    assert str(Path(torch.__file__).parent) in result.stderr  # the installed torch, found
    # the same interpreter without the overlay builds against its own torch
    result = _check_build_torch([], ["setup.py", "bdist_wheel"])
    assert result.returncode == 0, result.stderr
    assert f"built against {torch.__file__}" in result.stdout


def test_pip_install_without_no_build_isolation_stops_with_the_command(tmp_path):
    """The real thing: pip's isolated build stops at its first step, before compiling anything.

    torch is not a build requirement, so pip installs only setuptools and wheel into its
    isolated environment (seconds) and the build then stops, naming the right command.
    """
    src = tmp_path / "leanddp-src"
    src.mkdir()
    for name in ("setup.py", "build_support.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(tmp_path / "t"),
         str(src)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "leanddp: this build runs in an isolated environment" in output
    assert f"{sys.executable} -m pip install --no-build-isolation {src}" in output
    assert not (tmp_path / "t").exists()


def test_default_cuda_arch_list_is_one_pass_that_runs_on_every_supported_gpu():
    """Without a visible GPU: one device compilation per .cu file (the build time is mostly the
    host and device passes over torch's headers), with PTX that every GPU from sm_80 can run."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    value = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and getattr(node.targets[0], "id", "") == "DEFAULT_ARCH_LIST"
    )
    arches = value.split(";")
    assert len(arches) == 1, value  # one cicc + ptxas pass per .cu file
    arch = arches[0]
    assert arch.endswith("+PTX") and float(arch.removesuffix("+PTX")) <= 8.0, value

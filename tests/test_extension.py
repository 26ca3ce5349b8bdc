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
    assert info["cpu_isa"] in {"avx512", "avx2", "baseline"}
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

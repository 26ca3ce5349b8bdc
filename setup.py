"""Build leanddp's C++/CUDA extension ``leanddp._C`` against the torch already installed.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be
compiled against the very torch it will run with, so pip must not build it in an isolated
environment with a different torch. The build stops at once, printing that command, when it
runs in an isolated build environment (build_support.py); torch is therefore not among the
build requirements in pyproject.toml, so pip downloads nothing before it stops.

How long a clean build takes, and how to shorten it: docs/install.md, "Build time".

Build environment variables
---------------------------
LEANDDP_FORCE_CUDA=1     Build the CUDA kernels even if the automatic check says no; fails
                         if torch has no CUDA or nvcc cannot be found. ``FORCE_CUDA=1`` is
                         accepted too.
LEANDDP_CPU_ONLY=1       Never build the CUDA kernels (CPU kernels only). Calling an op on
                         CUDA tensors then raises an error that says how to rebuild.
TORCH_CUDA_ARCH_LIST     CUDA architectures, e.g. "8.0;9.0+PTX". Default: those of the visible
                         GPUs, or DEFAULT_ARCH_LIST below when no GPU is visible (building on
                         a machine without a GPU is supported).
CUDA_HOME / CUDA_PATH    CUDA toolkit root. Default: found from nvcc on PATH, else /usr/local/cuda.
MAX_JOBS                 Parallel compile jobs (ninja). Default: torch's choice (all cores).
LEANDDP_DEBUG=1          Compile with -O0 -g and without NDEBUG.
LEANDDP_SANITIZE=1       AddressSanitizer + UndefinedBehaviorSanitizer build, for testing only:
                         compiles and links the C++ with -fsanitize=address,undefined
                         -fno-omit-frame-pointer -g -O1 (-O0 with LEANDDP_DEBUG=1), plus
                         -fno-wrapv so that signed overflow is reported. Always CPU-only, as
                         with LEANDDP_CPU_ONLY=1 (an error with LEANDDP_FORCE_CUDA=1). GCC or
                         Clang. Python and torch are not instrumented, so the ASan runtime must
                         be preloaded (LD_PRELOAD) into every process that imports the result:
                         tests/scripts/sanitize.sh builds it in a copy of the tree and runs the
                         tests that way.
LEANDDP_COVERAGE=1       Line and branch coverage build (gcov), for testing only: compiles and
                         links the C++ with --coverage -O0 -g, -fprofile-update=atomic (hooks,
                         the offload worker and OpenMP threads count too) and __gcov_dump kept,
                         so that a process leaving by os._exit can write its counts first.
                         Always CPU-only, as with LEANDDP_CPU_ONLY=1 (an error with
                         LEANDDP_FORCE_CUDA=1 or LEANDDP_SANITIZE=1). GCC.
                         tests/scripts/coverage.sh builds it in a copy of the tree, runs the
                         tests and lists what they never ran (docs/gpu-only-code.md).

By default the CUDA kernels are built whenever the installed torch has CUDA
(``torch.version.cuda``) and a CUDA toolkit with nvcc is found; no GPU is needed.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
sys.path.insert(0, str(ROOT))
from build_support import check_build_torch  # noqa: E402

# Without a visible GPU: sm_80 machine code (A100) plus its PTX, which the driver compiles once
# for any newer GPU (H100/H200 and later; cached in ~/.nv/ComputeCache). One device pass instead
# of three (sm_80, sm_90, compute_90 PTX) keeps the build at a third of the nvcc time. The
# kernels are memory-bound element loops that use no sm_90 feature; the PTX rounds exactly as
# the machine code (no FMA contraction, --fmad=false). Set TORCH_CUDA_ARCH_LIST for native code.
DEFAULT_ARCH_LIST = "8.0+PTX"

#: csrc/*.cpp compile in this many groups, each one compiler run that includes its files (a "unity
#: build"): a file spends most of its compile time parsing torch's headers (about 9 s of 12), so
#: the 32 files take about 48 s of CPU time in two groups instead of about 400 one by one. The
#: files of csrc/ops/ compile one by one (cpu_kernels.cpp and flatten_cpu.cpp set instruction-set
#: macros of their own), as does every file in the testing builds (LEANDDP_DEBUG,
#: LEANDDP_SANITIZE, LEANDDP_COVERAGE: one object per file for gcov; only there does a file that
#: lacks an include it needs fail on its own). A function with internal linkage (static, an
#: anonymous namespace) is therefore named uniquely across csrc/*.cpp
#: (tests/ops/test_unity_build.py): a call could otherwise resolve to another file's overload.
UNITY_GROUPS = 2

#: The torch releases this source builds and is tested against (CI: 2.13 and 2.14 on the CPU; the
#: GPU suite: 2.11 with CUDA 13). The source distribution requires this range; a built wheel or
#: install requires the very torch it was compiled against (the extension is tied to its C++ ABI,
#: and ``import leanddp`` refuses another one).
SUPPORTED_TORCH = ">=2.11,<2.15"
#: Only a source distribution is being made: nothing is compiled, and torch is not needed.
SDIST_ONLY = "sdist" in sys.argv[1:]


def _version() -> str:
    """leanddp's version, from the one file that holds it (read, not imported)."""
    text = (ROOT / "python" / "leanddp" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE).group(1)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _find_cuda_home() -> str | None:
    """CUDA toolkit root: env, then nvcc's real location, then /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for cand in candidates:
        # nvcc on PATH may be a wrapper script: only accept a directory holding the headers.
        if (cand / "bin" / "nvcc").exists() and (cand / "include" / "cuda_runtime.h").exists():
            return str(cand)
    return None


# torch.utils.cpp_extension reads CUDA_HOME once, at import: resolve it first.
_cuda_home = _find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home

if not SDIST_ONLY:  # (a source distribution needs no torch: MANIFEST.in lists what it holds)
    check_build_torch(str(ROOT), sys.argv)  # before anything else of torch is imported
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension


def _want_cuda() -> bool:
    force = _flag("LEANDDP_FORCE_CUDA") or _flag("FORCE_CUDA")
    for cpu_only in ("LEANDDP_CPU_ONLY", "LEANDDP_SANITIZE", "LEANDDP_COVERAGE"):
        if _flag(cpu_only):
            if force:
                raise RuntimeError(f"{cpu_only} and LEANDDP_FORCE_CUDA are both set; pick one")
            return False
    available = torch.version.cuda is not None and _cuda_home is not None
    if force and not available:
        raise RuntimeError(
            "LEANDDP_FORCE_CUDA=1 but the CUDA kernels cannot be built: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA toolkit={_cuda_home!r}. "
            "Install a CUDA build of torch and the CUDA toolkit (nvcc), or set CUDA_HOME."
        )
    return available


def _unity_sources(files: list[Path]) -> list[str]:
    """The generated files that compile ``files`` in UNITY_GROUPS groups (contiguous in sorted
    order), written under build/unity/ only when their text changes, so that ninja rebuilds a
    group when one of its files or their headers change (its dependency file lists them)."""
    out, sources = ROOT / "build" / "unity", []
    out.mkdir(parents=True, exist_ok=True)
    for g in range(UNITY_GROUPS):
        group = files[g * len(files) // UNITY_GROUPS : (g + 1) * len(files) // UNITY_GROUPS]
        text = (
            f"// Generated by setup.py: group {g + 1} of {UNITY_GROUPS} of csrc/*.cpp, compiled "
            "as one file (UNITY_GROUPS).\n" + "".join(f'#include "{f}"\n' for f in group)
        )
        path = out / f"csrc_{g}.cpp"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        sources.append(str(path.relative_to(ROOT)))
    return sources


def _extension():
    with_cuda = _want_cuda()
    debug = _flag("LEANDDP_DEBUG")
    testing = debug or _flag("LEANDDP_SANITIZE") or _flag("LEANDDP_COVERAGE")
    top = sorted((ROOT / "csrc").glob("*.cpp"))
    below = sorted(p for p in (ROOT / "csrc").rglob("*.cpp") if p.parent != ROOT / "csrc")
    if testing:
        sources = [str(p.relative_to(ROOT)) for p in sorted([*top, *below])]
    else:
        sources = [*_unity_sources(top), *(str(p.relative_to(ROOT)) for p in below)]
    # setuptools skips the extension when no source or dependency is newer than it
    headers = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cuh")]
    depends = [str(p.relative_to(ROOT)) for p in sorted([*top, *headers])]
    opt = ["-O0", "-g"] if debug else ["-O3"]  # C++ standard: torch's choice (C++20 from 2.14)
    link = []
    if _flag("LEANDDP_SANITIZE"):
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
        # -fno-wrapv undoes the -fwrapv in Python's CFLAGS, so UBSan reports signed overflow.
        opt = [*sanitize, "-fno-wrapv", "-g", "-O0" if debug else "-O1"]
        link += sanitize
    if _flag("LEANDDP_COVERAGE"):
        if _flag("LEANDDP_SANITIZE"):
            raise RuntimeError("LEANDDP_COVERAGE and LEANDDP_SANITIZE are both set; pick one")
        coverage = ["--coverage", "-fprofile-update=atomic"]
        opt = [*coverage, "-O0", "-g"]
        link += [*coverage, "-Wl,--undefined=__gcov_dump"]
    cxx = [*opt, "-fno-math-errno", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]
    if "-g" not in opt:
        # Python's CFLAGS (which torch's build puts first) carry -g: debug information for
        # torch's headers is about a third of each C++ file's compile time and most of the
        # library's size. Symbols stay, so stack traces still name functions.
        cxx.append("-g0")
    if platform.system() == "Linux":
        # at::parallel_for is OpenMP inlined into our code: without -fopenmp it silently runs on
        # one thread. The soname matches the libgomp torch ships, so one OpenMP runtime is used.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    # a string literal for build_info()["version"]: the compiled code and the Python files agree
    define_macros = [("LEANDDP_VERSION", f'"{_version()}"')]
    if not debug:
        define_macros.append(("NDEBUG", None))
    if platform.machine() in ("x86_64", "AMD64"):
        define_macros.append(("LEANDDP_X86_DISPATCH", None))
    if not with_cuda:
        return CppExtension(
            "leanddp._C",
            sources,
            depends=depends,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    # The .cu files take the longest: listed first, ninja starts them first.
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
    sources = cuda_sources + sources
    arches = os.environ.get("TORCH_CUDA_ARCH_LIST", "the visible GPUs")
    print(
        f"leanddp: building the CUDA kernels for {arches} ({len(cuda_sources)} .cu files and "
        f"{len(sources) - len(cuda_sources)} C++ ones; minutes on a few cores, docs/install.md "
        '"Build time"; pip install -v shows each file as it compiles)',
        file=sys.stderr,
    )
    define_macros.append(("LEANDDP_WITH_CUDA", None))
    # No fast math and no FMA contraction (like -ffp-contract=off on the host): the CUDA kernels
    # round exactly like the CPU kernels, so both backends give bit-identical results.
    nvcc = [*opt, "-lineinfo", "--fmad=false"]
    return CUDAExtension(
        "leanddp._C",
        sources,
        depends=depends,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
    )


# Optional features: `pip install leanddp[lowbit]` adds torchao, whose AdamW8bit / Adam8bit
# leanddp steps with its own 8-bit kernels (the tests that compare them need it too).
EXTRAS = {"lowbit": ["torchao>=0.18"]}

if SDIST_ONLY:
    setup(install_requires=[f"torch{SUPPORTED_TORCH}"], extras_require=EXTRAS)
else:
    setup(
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildExtension},
        install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
        extras_require=EXTRAS,
    )

"""The AVX-512 8-bit Adam update divides by its bias corrections without a division
instruction (``ExactDivisor``, csrc/ops/cpu_loops_8bit.h: a quotient from a two-part
reciprocal, corrected once by its exact remainder). tests/scripts/check_exact_division.cpp
compares it with the division, bit for bit, for every float in [1, 2) and a stride over all
others (signs, zeros, subnormals, infinities, NaNs, the ends of its range) and each divisor; here
it is built against the kernel's own header and run with 800 divisors (the header's comment says
why it cannot differ)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

import leanddp

pytestmark = pytest.mark.leanddp_paths  # a C++ check of leanddp's; CI's step 1 only

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    leanddp.build_info()["cpu_isa"] not in ("avx512", "avx512vbmi") or shutil.which("g++") is None,
    reason="ExactDivisor is the AVX-512 variant's: needs the CPU it runs on and g++",
)
def test_division_without_a_division_equals_it(tmp_path):
    binary = tmp_path / "check_exact_division"
    includes = [f"-I{p}" for p in include_paths()]
    source = ROOT / "tests" / "scripts" / "check_exact_division.cpp"
    subprocess.run(
        [
            "g++",
            "-O2",
            "-std=c++17",
            "-ffp-contract=off",
            f"-I{ROOT / 'csrc' / 'ops'}",
            *includes,
            str(source),
            "-o",
            str(binary),
        ],
        check=True,
        timeout=300,
    )
    run = subprocess.run([str(binary), "25", "200"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("0 mismatches"), run.stdout
    checked = int(run.stdout.split()[-4])
    assert checked == 8 * 25 * 2 + 2 * 200, run.stdout

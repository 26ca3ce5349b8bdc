"""Checks, in the built extension's machine code, that every instruction-set variant of the CPU
kernels' inner loops is vectorized: each loop must use the packed instructions of its variant's
vector registers (baseline: SSE on xmm; AVX2: ymm; AVX-512, with or without VBMI: zmm).

    python tests/scripts/check_vectorized.py [path/to/_C.so]

A loop the compiler could not vectorize (a branch inside it, a constant it must reload, a libm
call such as a software fmaf) compiles to scalar instructions only, and fails here. Prints one
line per (variant, loop) and exits 1 if any fails. Needs objdump (binutils); x86-64 only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

#: (loop, symbol pattern, packed instruction that proves it vectorized), per variant. Adam's
#: loops are the packed square root; SGD and scaling are packed multiplies (the fp16 one-pass
#: loops as well); the bf16 conversions
#: are packed integer shifts and the fp16 ones (F16C, AVX2 and AVX-512 only) packed converts;
#: 8-bit Adam's quantization divides by the block's scale in packed form. Its update loop serves
#: both kinds of state, and the compiler may inline it into their blocks' functions. Its
#: dequantization gathers (AVX2, AVX-512) or permutes bytes (AVX-512 VBMI); the baseline's is
#: scalar loads, and not checked. A dict maps variants to their instruction; variants it leaves
#: out are not checked for that loop.
LOOPS: list[tuple[str, str, str | dict[str, str]]] = [
    ("adam", r"::adam_(block|amp|loop)\b", r"sqrtps"),
    ("sgd", r"::sgd_(block|loop)\b", r"mulps"),
    ("scale float", r"scale_block<float>", r"mulps"),
    ("scale double", r"scale_block<double>", r"mulpd"),
    ("bf16 to float", r"convert_block<c10::BFloat16, float>", r"(pslld|punpcklwd|pmovzxwd)"),
    ("float to bf16", r"convert_block<float, c10::BFloat16>", r"(psrld|paddd|pand)"),
    ("fp16 to float", r"convert_block<c10::Half, float>", r"cvtph2ps"),
    ("float to fp16", r"convert_block<float, c10::Half>", r"cvtps2ph"),
    ("scale fp16", r"scale_half_block", r"mulps"),
    ("adam fp16", r"::adam_half_(block|amp|loop)\b", r"sqrtps"),
    ("sgd fp16", r"::sgd_half_(block|loop)\b", r"mulps"),
    (
        "adam8 update",
        r"::adam8_(quant_(loop|block|overlapped)\b|update_loop<(true|false), true>)",
        r"sqrtps",
    ),
    ("adam8 plain", r"::adam8_(plain_block\b|update_loop<(true|false), false>)", r"sqrtps"),
    ("adam8 quantize", r"::quant8(_block)?\b", r"divps"),
    (
        "adam8 dequantize",
        r"::dequant8(_shuffled)?\b",
        {"avx2": r"gatherdps", "avx512": r"gatherdps", "avx512vbmi": r"permi2b|permt2b"},
    ),
]
REGISTER = {"baseline": "%xmm", "avx2": "%ymm", "avx512": "%zmm", "avx512vbmi": "%zmm"}
NO_F16C = {"baseline"}  # x86-64's baseline has no fp16 conversion instructions
ONLY_8BIT = {"avx512vbmi"}  # AVX-512's loops but 8-bit Adam's (cpu_kernels.cpp)


def functions(so: Path) -> dict[str, list[str]]:
    """Demangled function name -> its disassembled instruction lines."""
    out = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(so)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            name = header.group(1)
            current = result.setdefault(name, []) if "leanddp::ops::isa_" in name else None
        elif current is not None and line.strip():
            current.append(line)
    return result


def check(so: Path) -> list[tuple[str, str, bool]]:
    """(variant, loop, vectorized) for every variant and loop."""
    code = functions(so)
    rows = []
    for isa, register in REGISTER.items():
        for loop, symbol, instructions in LOOPS:
            if isa in NO_F16C and "fp16" in loop or isa in ONLY_8BIT and "adam8" not in loop:
                continue
            if isinstance(instructions, dict) and isa not in instructions:
                continue
            instruction = instructions[isa] if isinstance(instructions, dict) else instructions
            lines = [
                line
                for name, body in code.items()
                if f"isa_{isa}::" in name and re.search(symbol, name)
                for line in body
            ]
            packed = re.compile(rf"\s(v?({instruction}))\s.*{re.escape(register)}")
            rows.append((isa, loop, bool(lines) and any(packed.search(x) for x in lines)))
    return rows


def main(argv: list[str]) -> int:
    if argv:
        so = Path(argv[0])
    else:
        import leanddp

        so = next(Path(leanddp.__file__).parent.glob("_C*.so"))
    if shutil.which("objdump") is None:
        print("objdump not found (install binutils)", file=sys.stderr)
        return 2
    rows = check(so)
    for isa, loop, ok in rows:
        print(f"{isa:10} {loop:16} {'vectorized' if ok else 'NOT VECTORIZED'}")
    return 0 if all(ok for _, _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The CPU kernels' instruction-set variants (baseline, AVX2, AVX-512, AVX-512 with VBMI) against
torch, bit for bit.

Each variant runs in its own process, pinned with LEANDDP_CPU_ISA, beside torch's fused AdamW
and for-loop SGD pinned to the matching capability with ATEN_CPU_CAPABILITY (baseline: torch's
DEFAULT, which computes multiply-adds unfused as our baseline does on x86-64; AVX2 and AVX-512:
with FMA). Adam(W) of float32, bfloat16 and float16 parameters must equal torch's every bit
(tails included: torch's scalar loop fuses another product), and so must float32 SGD; and
every output of every op (Adam with bf16/fp16 gradients and a parameter copy, SGD, flatten with
a scale, 8-bit Adam) must be equal across the variants that share FMA (AVX2 and AVX-512, and the
baseline for flatten and 8-bit Adam, which have no multiply-add).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.leanddp_paths  # leanddp's kernels; CI's step 1 only (pyproject.toml)

SCRIPT = r"""
import itertools, sys, torch, leanddp
from leanddp import ops
# The data comes from the parent: torch's own random numbers depend on its capability.
pool, at = torch.load(sys.argv[2]), 0
def randn(n):
    global at
    at = (at + n) % (pool.numel() - n)
    return pool[at:at + n].clone()
sizes = [1, 3, 17, 31, 1000, 4099, 70001]  # tails of 1 to 15 elements past whole vectors
out = {"isa": leanddp.build_info()["cpu_isa"], "torch": torch.backends.cpu.get_cpu_capability()}
hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
# Adam(W), ours against torch's fused kernel on the same data: float32, bf16 and fp16
# parameters, both of lerp's forms (1 - beta1 below and above 1/2)
for pdt, decoupled, beta1 in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), (True, False), (0.9, 0.3)):
    hyper["beta1"] = beta1
    ours = [[randn(n).to(pdt) for n in sizes]] + [
        [torch.zeros(n, dtype=pdt) for n in sizes] for _ in range(2)]
    ref = [[t.clone() for t in ts] for ts in ours]
    steps = [torch.zeros(()) for _ in sizes]
    for step in (1, 2, 3):
        g = [randn(n).to(pdt) for n in sizes]
        op = ops.adamw_step_ if decoupled else ops.adam_step_
        op(ours[0], g, ours[1], ours[2], step=step, **hyper)
        for s in steps:
            s += 1
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused(ref[0], g, ref[1], ref[2], [], steps, amsgrad=False, maximize=False,
              **hyper)
    out[f"adam {pdt} decoupled={decoupled} beta1={beta1}"] = (ours, ref)
hyper["beta1"] = 0.9
# SGD of float32 parameters, ours against torch's for-loop SGD on the same data: momentum with
# dampening (maximizing), Nesterov, none
for cfg in (dict(momentum=0.5, dampening=0.2, nesterov=False, maximize=True),
            dict(momentum=0.9, dampening=0.0, nesterov=True, maximize=False),
            dict(momentum=0.0, dampening=0.0, nesterov=False, maximize=False)):
    ours = [randn(n) for n in sizes]
    ref = [torch.nn.Parameter(t.clone()) for t in ours]
    opt = torch.optim.SGD(ref, lr=0.05, weight_decay=0.01, foreach=False, **cfg)
    bufs = [torch.zeros(n) for n in sizes] if cfg["momentum"] else None
    for step in (1, 2, 3):
        g = [randn(n) for n in sizes]
        ops.sgd_step_(ours, g, bufs, lr=0.05, weight_decay=0.01, first_step=step == 1, **cfg)
        for r, gi in zip(ref, g):
            r.grad = gi.clone()
        opt.step()
    out[f"sgd vs torch {cfg}"] = (ours, [r.detach() for r in ref])
# Every op's outputs, for the comparison across variants
for gdt in (torch.float32, torch.bfloat16, torch.float16):
    p = [randn(n) for n in sizes]
    m, v, b = ([torch.zeros(n) for n in sizes] for _ in range(3))
    copy = [torch.empty(n, dtype=torch.float16) for n in sizes]
    for step in (1, 2, 3):
        g = [randn(n).to(gdt) for n in sizes]
        ops.adamw_step_(p, g, m, v, step=step, grad_scale=0.7, param_copy=copy, **hyper)
        ops.sgd_step_(p, g, b, lr=0.1, momentum=0.9, dampening=0.0, nesterov=True,
                      weight_decay=0.01, first_step=step == 1)
    out["adam+sgd " + str(gdt)] = [p, m, v, b, copy]
    sgd_p = [randn(n) for n in sizes]
    ops.sgd_step_(sgd_p, g, [torch.zeros(n) for n in sizes], lr=0.1, momentum=0.9,
                  dampening=0.1, nesterov=False, weight_decay=0.01, first_step=True)
    out["sgd " + str(gdt)] = sgd_p
# SGD over 16-bit parameters, gradients and momentum (fp16: one pass, without float buffers,
# where the instruction set converts fp16)
for dt in (torch.bfloat16, torch.float16):
    p, b = [randn(n).to(dt) for n in sizes], [torch.zeros(n, dtype=dt) for n in sizes]
    for step in (1, 2, 3):
        g = [randn(n).to(dt) for n in sizes]
        ops.sgd_step_(p, g, b, lr=0.1, momentum=0.9, dampening=0.0, nesterov=True,
                      weight_decay=0.01, first_step=step == 1)
        ops.sgd_step_(p, g, None, lr=0.1, momentum=0.0, dampening=0.0, nesterov=False,
                      weight_decay=0.0, first_step=False, amp_scale=torch.tensor(2.0))
    out["sgd params " + str(dt)] = [p, b]
for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    ts = [randn(n).to(dt) for n in sizes]
    flat = torch.empty(sum(sizes), dtype=dt)
    ops.flatten_into(ts, flat, scale=1.3)
    out["flat" + str(dt)] = flat
# 8-bit Adam(W) (no multiply-add: every variant must give the same bits), on sorted maps of
# this script's own (torchao is an optional dependency), and the quantizer's two paths
qs = torch.cat([-torch.logspace(0, -7, 127), torch.zeros(1), torch.logspace(-7, 0, 128)])
qu = torch.cat([torch.zeros(1), torch.logspace(-8, 0, 255)])
sizes8 = [4096, 512 * 3, 300]  # two with 8-bit state (blocks of 256), one plain
for dt in (torch.float32, torch.bfloat16):
    p = [randn(n).to(dt) for n in sizes8]
    m = [torch.zeros(n, dtype=torch.uint8 if n % 256 == 0 else dt) for n in sizes8]
    v = [t.clone() for t in m]
    sm = [torch.zeros(n // 256 if n % 256 == 0 else 0) for n in sizes8]
    sv = [t.clone() for t in sm]
    for step in (1, 2, 3):
        g = [randn(n).to(dt) for n in sizes8]
        ops.adam8bit_step_(p, g, m, v, sm, sv, qs, qu, lr=1e-2, beta1=0.9, beta2=0.99,
                           eps=1e-8, weight_decay=0.1, step=step, grad_scale=0.9)
    out["adam8 " + str(dt)] = [p, m, v, sm, sv]
# Runs of blocks (the AVX-512 loops step up to 8 at a time, each block's update beside the
# previous block's quantization), AdamW and Adam: 21 blocks of 128, where some blocks' second
# moments turn infinite (in the middle of the first run of 8, at its end, at the start of the
# second, and the last block) and block 5's moments NaN (such blocks quantize apart), and 12
# blocks of 40 (not whole vectors)
n_runs = [128 * 21, 40 * 12]
for decoupled in (True, False):
    p = [randn(n) for n in n_runs]
    m = [torch.zeros(n, dtype=torch.uint8) for n in n_runs]
    v = [t.clone() for t in m]
    sm = [torch.zeros(n // b) for n, b in zip(n_runs, (128, 40))]
    sv = [t.clone() for t in sm]
    for step in (1, 2, 3):
        g = [randn(n) for n in n_runs]
        for block in (2, 7, 8, 20):
            g[0][block * 128 + 5] = 1e20  # squared: infinite
        if step == 2:
            g[0][5 * 128 + 7] = float("nan")
        ops.adam8bit_step_(p, g, m, v, sm, sv, qs, qu, lr=1e-2, beta1=0.9, beta2=0.99,
                           eps=1e-8, weight_decay=0.1, step=step,
                           decoupled_weight_decay=decoupled)
    out[f"adam8 runs {decoupled}"] = [t.view(torch.int32) for t in p + sm + sv] + m + v
# The update at edge values (the AVX-512 loop divides by the bias corrections without a division
# instruction: ExactDivisor). Plain state holds the moments as given: lanes drawn from
# moderate values (zeros of both signs included) and, in a second parameter, from tiny,
# subnormal and huge ones too, with gradients from 0 to 1e20 there (whose square is infinite:
# some parameters end as NaN).
moderate = torch.tensor([0.0, -0.0, 1.0, -1e-3, 1e-18, -1e29, 3e-7, 2.5])
extreme = torch.cat([moderate, torch.tensor([1e-30, -1e-40, 1e-19, -1e31, 3e38])])
pick = lambda values, n: values[(randn(n).abs() * 1e4).long() % values.numel()]
n8, big = 16 * 40 + 5, [0.0, 1.0, 1e-3, 1e20]
for decoupled, beta1 in itertools.product((True, False), (0.9, 0.3)):  # both lerp forms
    # and a third of negative zeros (Adam, beta1 0.3: the first moment stays -0.0, and so does
    # its quotient, which the parameter's sign shows)
    p = [pick(moderate, n8) * randn(n8), randn(n8), torch.full((32,), -0.0)]
    m = [pick(moderate, n8), pick(extreme, n8), torch.full((32,), -0.0)]
    v = [pick(moderate, n8).abs(), pick(extreme, n8).abs(), torch.ones(32)]
    for step in (1, 2, 3):
        g = [randn(n8) * pick(torch.tensor(scales), n8) for scales in ([0.0, 1.0, 1e-3], big)]
        g.append(torch.full((32,), -0.0))
        ops.adam8bit_step_(p, g, m, v, [torch.zeros(0)] * 3, [torch.zeros(0)] * 3, qs, qu,
                           lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=0.1,
                           step=step, decoupled_weight_decay=decoupled)
    # bits: NaNs and the signs of zeros compare too
    out[f"adam8 edges {decoupled} {beta1}"] = [t.view(torch.int32) for t in p + m + v]
# and, in whole vectors and the remainder, what only the unbounded path sees
specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3e38, -3e38,
                         2.0, -2.0, -0.0, 0.0, 1e-40, -1e-40] * 3)
x = torch.cat([specials, randn(100_000).clamp(-1, 1), specials[:7]])
quantize8 = leanddp._C._testing.quantize8
out["adam8 quantize"] = [quantize8(x, qs, True), quantize8(x, qs, False),
                        quantize8(x.abs(), qu, True)]
codes = (randn(64 * 40 + 21).abs() * 1e4).long().remainder(256).to(torch.uint8)
dequantize8 = leanddp._C._testing.dequantize8
out["adam8 dequantize"] = [dequantize8(codes, q, 0.37, table=t) for q in (qs, qu)
                           for t in (True, False)]
torch.save(out, sys.argv[1])
"""

#: torch's capability matching each of our variants.
TORCH_CAPABILITY = {
    "baseline": "default",
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512vbmi": "avx512",
}


def _leaves(tree: object) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_leaves(tree)


def test_isa_variants_equal_torch_and_each_other(tmp_path):
    results = {}
    pool = tmp_path / "pool.pt"
    torch.save(torch.randn(1 << 20), pool)
    for isa, capability in TORCH_CAPABILITY.items():
        path = tmp_path / f"{isa}.pt"
        env = dict(os.environ, LEANDDP_CPU_ISA=isa, ATEN_CPU_CAPABILITY=capability)
        subprocess.run(
            [sys.executable, "-c", SCRIPT, str(path), str(pool)], env=env, check=True, timeout=300
        )
        out = torch.load(path)
        if out.pop("isa") == isa:  # this CPU supports it
            assert out.pop("torch").lower() == capability.lower(), "torch ran another capability"
            results[isa] = out
    assert "baseline" in results
    if platform.machine() in ("x86_64", "AMD64"):
        assert len(results) >= 2, "an x86-64 CPU without AVX2: nothing to compare"
    for isa, out in results.items():
        for key in [k for k in out if k.startswith(("adam ", "sgd vs torch "))]:
            ours, ref = out.pop(key)
            for a, b in zip(_leaves(ours), _leaves(ref), strict=True):
                assert torch.equal(a, b), f"{isa}: {key} differs from torch's kernel"
    fma_free = ("flat", "adam8")  # ops without a multiply-add: equal on every variant
    for isa, out in results.items():
        for other, other_out in results.items():
            same_fma = (isa == "baseline") == (other == "baseline")
            for key, value in out.items():
                if not same_fma and not key.startswith(fma_free):
                    continue
                for a, b in zip(_leaves(value), _leaves(other_out[key]), strict=True):
                    assert torch.equal(a, b), f"{isa} differs from {other} in {key}"


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
    reason="the variants are x86-64's; the check reads machine code with objdump",
)
def test_every_variant_vectorizes():
    """The built kernels' inner loops use their variant's packed instructions
    (tests/scripts/check_vectorized.py): a loop the compiler left scalar fails here."""
    script = Path(__file__).parents[1] / "scripts" / "check_vectorized.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr

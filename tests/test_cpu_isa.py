"""The CPU kernels' instruction-set variants (baseline, AVX2, AVX-512) give bit-identical results.

The default variant is checked against torch by the other tests; these runs pin the others with
LEANDDP_CPU_ISA and compare every output bit for bit (no FMA contraction, IEEE sqrt/division).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch

SCRIPT = r"""
import sys, torch, leanddp
from leanddp import ops
torch.manual_seed(int(sys.argv[2]))
sizes = [1, 3, 17, 1000, 4099, 70001]
out = {"isa": leanddp.build_info()["cpu_isa"]}
for gdt in (torch.float32, torch.bfloat16, torch.float16):
    p = [torch.randn(n) for n in sizes]
    m, v, b = ([torch.zeros(n) for n in sizes] for _ in range(3))
    copy = [torch.empty(n, dtype=torch.float16) for n in sizes]
    for step in (1, 2, 3):
        g = [torch.randn(n).to(gdt) for n in sizes]
        ops.adamw_step_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.1, step=step, grad_scale=0.7, param_copy=copy)
        ops.sgd_step_(p, g, b, lr=0.1, momentum=0.9, dampening=0.0, nesterov=True,
                      weight_decay=0.01, first_step=step == 1)
    out[str(gdt)] = [p, m, v, b, copy]
for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    ts = [torch.randn(n).to(dt) for n in sizes]
    flat = torch.empty(sum(sizes), dtype=dt)
    ops.flatten_into(ts, flat, scale=1.3)
    out["flat" + str(dt)] = flat
torch.save(out, sys.argv[1])
"""


def test_isa_variants_are_bit_identical(tmp_path):
    seed = torch.initial_seed() % 2**31
    results = {}
    for isa in ("baseline", "avx2", "avx512"):
        path = tmp_path / f"{isa}.pt"
        env = dict(os.environ, LEANDDP_CPU_ISA=isa)
        subprocess.run(
            [sys.executable, "-c", SCRIPT, str(path), str(seed)], env=env, check=True, timeout=300
        )
        out = torch.load(path)
        if out.pop("isa") == isa:  # this CPU supports it
            results[isa] = out
    assert "baseline" in results
    if platform.machine() in ("x86_64", "AMD64"):
        assert len(results) >= 2, "an x86-64 CPU without AVX2: nothing to compare"
    reference_isa, reference = next(iter(results.items()))
    for isa, out in results.items():
        for key, value in out.items():
            flat_ref = torch.utils._pytree.tree_leaves(reference[key])
            flat_out = torch.utils._pytree.tree_leaves(value)
            for a, b in zip(flat_ref, flat_out, strict=True):
                assert torch.equal(a, b), f"{isa} differs from {reference_isa} in {key}"

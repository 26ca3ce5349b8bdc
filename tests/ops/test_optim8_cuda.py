"""The 8-bit Adam(W) op's CUDA kernel against its CPU kernel, bit for bit (GPU only).

Both compute optim8_math.h's operations with no fused multiply-add and IEEE division and square
root, with constants computed once on the host, so every parameter, code and scale must agree
(the CPU kernel itself equals torchao's step bit for bit: test_optim8_ops.py). The maps are
sorted tables of this file's own, so torchao is not needed on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from leanddp import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

QS = torch.cat([-torch.logspace(0, -7, 127), torch.zeros(1), torch.logspace(-7, 0, 128)])
QU = torch.cat([torch.zeros(1), torch.logspace(-8, 0, 255)])
# 8-bit state in blocks of 256 and of 4096 (the kernels' largest), and plain state
SIZES = [(64 * 256, 256), (2 * 4096, 4096), (1000, 0), (70_001, 0)]


def _state(device: str, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.randn(n).to(dtype) for n, _ in SIZES]
    m = [torch.zeros(n, dtype=torch.uint8 if b else dtype) for n, b in SIZES]
    sm = [torch.zeros(n // b if b else 0) for n, b in SIZES]
    lists = [params, m, [t.clone() for t in m], sm, [t.clone() for t in sm]]
    return [[t.to(device) for t in lst] for lst in lists]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_cuda_kernel_equals_cpu_kernel(dtype, grad_dtype, decoupled):
    if dtype == torch.bfloat16 and grad_dtype != dtype:
        pytest.skip("bf16 parameters take bf16 gradients")
    ours = {dev: _state(dev, dtype) for dev in ("cpu", "cuda")}
    copies = {dev: [] for dev in ours}
    if dtype == torch.float32:
        copies = {dev: [torch.empty(n, dtype=torch.bfloat16, device=dev) for n, _ in SIZES]
                  for dev in ours}  # fmt: skip
    for step in range(1, 5):
        grads = [torch.randn(n).to(grad_dtype) for n, _ in SIZES]
        for dev, (p, m, v, sm, sv) in ours.items():
            ops.adam8bit_step_(
                p, [g.to(dev) for g in grads], m, v, sm, sv, QS.to(dev), QU.to(dev),
                lr=1e-2, beta1=0.9 if step % 2 else 0.3, beta2=0.99, eps=1e-8,
                weight_decay=0.1, step=step, decoupled_weight_decay=decoupled,
                grad_scale=0.5 if step == 2 else None, param_copy=copies[dev],
                found_inf=torch.zeros((), device=dev),
            )  # fmt: skip
    for k, (a, b) in enumerate(zip(ours["cpu"], ours["cuda"], strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y.cpu()), f"list {k} tensor {i} differs"
    for x, y in zip(copies["cpu"], copies["cuda"], strict=True):
        assert torch.equal(x, y.cpu())


def test_cuda_found_inf_skips_the_step():
    p, m, v, sm, sv = _state("cuda", torch.float32)
    before = [t.clone() for t in p + m + sm]
    grads = [torch.randn_like(t) for t in p]
    ops.adam8bit_step_(
        p, grads, m, v, sm, sv, QS.cuda(), QU.cuda(), lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
        weight_decay=0.1, step=1, found_inf=torch.ones((), device="cuda"),
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, p + m + sm, strict=True))

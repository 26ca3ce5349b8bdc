"""CUDA ops' per-launch metadata (csrc/ops/cuda/common.cuh): passed by value in the kernel's
parameters when it fits in kMetaArgBytes (3552 bytes), uploaded to the device beyond. Both paths
against torch.cat / torch's optimizers and the CPU kernels, and CUDA graph capture, which works
by value and is refused (before anything is written) when the metadata would be uploaded.
Skipped without a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from cpu_tails import assert_equal_but_tails

from leanddp import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

# A few tensors' records and chunks fit by value; 600 tensors' records alone (32 bytes each for
# flatten, 48 for the optimizers) are several times the limit.
FEW, MANY = 3, 600


def _tensors(count: int, device: str = "cuda") -> list[torch.Tensor]:
    """Random sizes, a third of them permuted (channels_last, transposed: the strided path)."""
    out = []
    for i in range(count):
        n = random.randint(1, 300)
        if i % 3 == 1:
            out.append(
                torch.randn(2, 3, n, 2, device=device).contiguous(memory_format=torch.channels_last)
            )
        elif i % 3 == 2:
            out.append(torch.randn(n, 5, device=device).t())
        else:
            out.append(torch.randn(n, device=device))
    return out


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


@pytest.mark.parametrize("count", [FEW, MANY], ids=["by_value", "uploaded"])
def test_flatten_and_unflatten_match_torch(count):
    ts = _tensors(count)
    total = sum(t.numel() for t in ts)
    out = torch.full((total + 5,), 7.0, device="cuda")
    ops.flatten_into(ts, out, scale=0.5)
    assert torch.equal(out[:total], _cat(ts) * 0.5)
    assert torch.equal(out[total:], torch.full((5,), 7.0, device="cuda"))
    back = [torch.zeros_like(t) for t in ts]
    ops.unflatten_from(out, back, scale=2.0)
    for t, b in zip(ts, back, strict=True):
        assert torch.equal(b, t)


@pytest.mark.parametrize("count", [FEW, MANY], ids=["by_value", "uploaded"])
def test_adamw_and_sgd_match_cpu_and_torch(count):
    shapes = [t.shape for t in _tensors(count, "cpu")]
    cpu = [[torch.randn(s) for s in shapes] for _ in range(4)]  # params, m, v, momentum
    gpu = [[t.cuda() for t in lst] for lst in cpu]
    ref = [p.clone().cuda().requires_grad_(True) for p in cpu[0]]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grads = [torch.randn(s) for s in shapes]
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.cuda()
        ref_opt.step()
        for (p, m, v, _), g in zip((cpu, gpu), (grads, [g.cuda() for g in grads]), strict=True):
            ops.adamw_step_(
                p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=step
            )
    for a, b, r in zip(cpu[0], gpu[0], ref, strict=True):
        assert_equal_but_tails(a, b, torch.float32)
        torch.testing.assert_close(b, r.detach(), rtol=1e-5, atol=1e-6)
    sgd = dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
    grads = [torch.randn(s) for s in shapes]
    ops.sgd_step_(cpu[0], grads, cpu[3], first_step=True, **sgd)
    ops.sgd_step_(gpu[0], [g.cuda() for g in grads], gpu[3], first_step=True, **sgd)
    for a, b in zip(cpu[0] + cpu[3], gpu[0] + gpu[3], strict=True):
        assert_equal_but_tails(a, b, torch.float32)


def test_by_value_launches_are_captured_in_a_cuda_graph():
    ts = _tensors(FEW)
    out = torch.empty(sum(t.numel() for t in ts), device="cuda")
    params = [torch.randn(50, device="cuda") for _ in range(FEW)]
    grads = [torch.randn_like(p) for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture, as torch recommends
        ops.flatten_into(ts, out, scale=2.0)
        ops.sgd_step_([p.clone() for p in params], grads, [b.clone() for b in bufs], **sgd)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.flatten_into(ts, out, scale=2.0)
        ops.sgd_step_(params, grads, bufs, first_step=True, **sgd)
    for t in ts:
        t.copy_(torch.randn_like(t))
    out.zero_()
    expected_params = [p - 0.1 * g for p, g in zip(params, grads, strict=True)]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _cat(ts) * 2.0)
    for p, e, b, g in zip(params, expected_params, bufs, grads, strict=True):
        assert torch.equal(b, g)
        torch.testing.assert_close(p, e)


def test_uploading_launches_refuse_capture_before_writing():
    ts = _tensors(MANY)
    out = torch.zeros(sum(t.numel() for t in ts), device="cuda")
    graph = torch.cuda.CUDAGraph()
    refused = pytest.raises(RuntimeError, match=r"flatten_into cannot be captured in a CUDA graph")
    with refused, torch.cuda.graph(graph):
        ops.flatten_into(ts, out)
    torch.cuda.synchronize()
    assert not out.any(), "a refused capture wrote to out"


# Past 2**31 elements: element offsets, chunk starts and loop indices must be 64-bit. bfloat16
# keeps each buffer at 4 GiB (about 17 GiB in all on the GPU).
BIG = 2**31 + 4099


def _needs(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")


def _edges(n: int) -> list[slice]:
    """Where 32-bit arithmetic would go wrong: the start, around 2**31, the end."""
    return [slice(0, 4096), slice(2**31 - 2048, 2**31 + 2048), slice(n - 4096, n)]


def test_flatten_and_unflatten_past_2_31_elements():
    """A bucket of more than 2**31 elements (4 GiB of bfloat16) from two tensors, the second
    starting past 2**30 and ending past 2**31, and back: values at the start, around 2**31 and
    at the end where they belong."""
    _needs(17)
    first = 2**30 + 3
    a = torch.arange(first, device="cuda").remainder_(251).bfloat16()
    b = torch.arange(BIG - first, device="cuda").remainder_(241).bfloat16()
    flat = torch.full((BIG,), -1.0, dtype=torch.bfloat16, device="cuda")
    ops.flatten_into([a, b], flat)
    for cut in _edges(BIG):
        idx = torch.arange(cut.start, cut.stop, device="cuda")
        want = torch.where(idx < first, idx % 251, (idx - first) % 241).bfloat16()
        assert torch.equal(flat[cut], want), cut
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    ops.unflatten_from(flat, [a2, b2])
    assert torch.equal(a2, a) and torch.equal(b2, b)


def test_adamw_past_2_31_elements_matches_the_cpu_kernel():
    """One AdamW step over a bfloat16 parameter of more than 2**31 elements: the elements at
    the start, around 2**31 and at the end equal the CPU kernel's on the same values."""
    _needs(17)
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=gen)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    cuts = _edges(BIG)
    cpu = [[t[c].cpu() for c in cuts] for t in (p, g, m, v)]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    ops.adamw_step_([p], [g], [m], [v], **hyper)
    ops.adamw_step_(*cpu, **hyper)
    for k, cut in enumerate(cuts):
        for ours, theirs in ((p, cpu[0][k]), (m, cpu[2][k]), (v, cpu[3][k])):
            assert torch.equal(ours[cut].cpu(), theirs), cut

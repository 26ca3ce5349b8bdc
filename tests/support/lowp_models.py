"""optimizer_in_backward on bfloat16/float16 parameters beside torch's DDP: a small model in the
dtype, the pair of wrappers over copies of it, their loss, and the comparison of their weights
within ulps of the dtype (test_in_backward_lowp.py, and the sharded bfloat16 cases of
test_shard_parity.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import leanddp

#: one ulp of each dtype, relative to the value
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}


def lowp_model(dtype: torch.dtype, device: str) -> nn.Module:
    """Three Linear layers in ``dtype``, the same weights at every call (on every rank)."""
    torch.manual_seed(7)  # the same weights on both ranks and for both copies
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 4)
    ).to(device, dtype)


def lowp_pair(dtype: torch.dtype, device: str, factory, ref_factory, **kw):
    """(leanddp stepping ``factory``'s optimizer inside backward, torch's DDP, torch's optimizer
    from ``ref_factory``) over two copies of ``lowp_model``, tiny buckets; ``kw`` to leanddp."""
    ours = leanddp.DistributedDataParallel(
        lowp_model(dtype, device), optimizer_in_backward=factory, bucket_cap_mb=0.001, **kw
    )
    ref = TorchDDP(lowp_model(dtype, device), bucket_cap_mb=0.001)
    return ours, ref, ref_factory(ref.parameters())


def mean_square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss both sides train on: the mean square of the output, in float32."""
    return model(x).float().pow(2).mean()


def ulp_tolerance(device: str, name: str = "adamw") -> tuple[int, float]:
    """(ulps, fraction bitwise equal) against torch's optimizer. On the CPU, Adam(W) rounds as
    torch's fused kernel; its CUDA kernel forms the moments with other multiply-adds (its
    compiler contracts them), so a few elements land an ulp apart and drift further."""
    if name == "sgd":
        return 2, 0.9
    return (1, 0.99) if device == "cpu" else (2, 0.9)


def assert_within_ulps(
    ours: nn.Module,
    ref: nn.Module,
    dtype: torch.dtype,
    what: str,
    ulps: int = 1,
    bitwise: float = 0.99,
) -> None:
    """Every parameter of ``ours`` still in ``dtype`` and within ``ulps`` of ``ref``'s, and at
    least the fraction ``bitwise`` of their elements equal bit for bit."""
    same = total = 0
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == dtype, f"{what}: {name} became {p.dtype}"
        a, b = p.detach().float(), q.detach().float()
        tol = ulps * ULP[dtype] * (b.abs() + 0.125)  # (near 0: an ulp of 1/8)
        bad = (a - b).abs() > tol
        assert not bad.any(), (
            f"{what}: {name} differs by {(a - b).abs().max().item()} (> {ulps} ulp)"
        )
        same += int((p.detach() == q.detach()).sum())
        total += p.numel()
    assert same >= bitwise * total, f"{what}: only {same}/{total} elements bitwise equal to torch's"

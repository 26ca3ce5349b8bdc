"""optimizer_in_backward on bfloat16/float16 parameters, GradScaler and a tensor lr, against
torch's DDP followed by torch's fused optimizer (or GradScaler) in the same processes, on random
data, over several steps.

The fused kernels step bf16/fp16 parameters in float32 math with the state in the parameters'
dtype and round each result once, with the multiply-adds torch's CPU kernels fuse, as torch's
fused kernels do: Adam(W) must agree within one ulp of the dtype (relative 2**-7 for bfloat16,
2**-10 for float16), and at least 99% of the parameters bitwise.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from lowp_models import assert_within_ulps, lowp_pair, mean_square, ulp_tolerance
from torch.utils._python_dispatch import TorchDispatchMode

STEPS = 5


def _parity(rank: int, dtype: torch.dtype, name: str, accum: int, device: str) -> None:
    cls, kw = {
        "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
        "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=0.01)),
    }[name]
    # torch 2.13's CPU fused SGD leaves bf16/fp16 parameters unchanged (its vectorized loop
    # never stores them): the reference is its foreach SGD, which rounds every intermediate
    # (d_p, the momentum buffer's mul_ and add_) to the dtype where the fused kernels round
    # once, so SGD is held to 2 ulps and 90% bitwise.
    impl = dict(foreach=True) if name == "sgd" else dict(fused=True)
    ours, ref, ref_opt = lowp_pair(
        dtype, device, functools.partial(cls, **kw), functools.partial(cls, **impl, **kw)
    )
    ulps, bitwise = ulp_tolerance(device, name)
    what = f"{dtype} {name} accum={accum}"
    for step in range(STEPS):
        xs = [torch.randn(6, 16, dtype=dtype, device=device) for _ in range(accum)]
        for k, x in enumerate(xs):
            if k < accum - 1:
                with ours.no_sync(), ref.no_sync():
                    mean_square(ours, x).backward()
                    mean_square(ref, x).backward()
            else:
                mean_square(ours, x).backward()
                mean_square(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours.optimizer.step()
        assert_within_ulps(ours.module, ref.module, dtype, f"{what} step {step}", ulps, bitwise)
    # The fused kernels stepped every bucket (not the per-bucket Python fallback), with the
    # state in the parameters' dtype.
    assert ours._in_backward.fallback.calls == 0, f"{what}: the Python fallback stepped"
    for p in ours.module.parameters():
        state = ours.optimizer.state[p]
        key = "momentum_buffer" if name == "sgd" else "exp_avg"
        assert state[key].dtype == dtype, f"{what}: state is {state[key].dtype}"


def _grad_scaler(rank: int, device: str) -> None:
    dtype = torch.float16
    kw = dict(lr=1e-2, weight_decay=0.1)
    # 2**40 and 2**24 overflow every gradient (the output's gradient is already inf in fp16), so
    # every bucket is skipped, as torch skips the whole step; then clean steps, which grow the
    # scale every 2 steps.
    scaler_kw = dict(init_scale=2.0**40, backoff_factor=2.0**-16, growth_interval=2)
    ours_scaler = torch.amp.GradScaler(device, **scaler_kw)
    ref_scaler = torch.amp.GradScaler(device, **scaler_kw)
    ours, ref, ref_opt = lowp_pair(
        dtype,
        device,
        functools.partial(torch.optim.AdamW, **kw),
        functools.partial(torch.optim.AdamW, fused=True, **kw),
        grad_scaler=ours_scaler,
    )
    before = [p.detach().clone() for p in ours.module.parameters()]
    scales = []
    for step in range(8):
        x = torch.randn(6, 16, dtype=dtype, device=device)
        ours_scaler.scale(mean_square(ours, x)).backward()
        ref_scaler.scale(mean_square(ref, x)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        ours_scaler.step(ours.optimizer)
        ours_scaler.update()
        assert ours_scaler.get_scale() == ref_scaler.get_scale(), (
            f"step {step}: scale {ours_scaler.get_scale()} != torch's {ref_scaler.get_scale()}"
        )
        scales.append(ref_scaler.get_scale())
        if step == 0:
            for p, b in zip(ours.module.parameters(), before, strict=True):
                assert p.equal(b), "an overflowing step changed a parameter"
        assert_within_ulps(
            ours.module, ref.module, dtype, f"GradScaler step {step}", *ulp_tolerance(device)
        )
        for p, q in zip(ours.module.parameters(), ref.module.parameters(), strict=True):
            s, r = ours.optimizer.state[p], ref_opt.state[q]
            if "step" in r:
                assert float(s["step"]) == float(r["step"]), f"step {step}: step counts differ"
    # Two overflows (backed off), then clean steps grown every growth_interval.
    assert scales[:3] == [2.0**24, 2.0**8, 2.0**8] and scales[-1] > 2.0**8, scales
    assert ours._in_backward.fallback.calls == 0


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _tensor_lr(rank: int, device: str) -> None:
    dtype = torch.bfloat16
    ours, ref, ref_opt = lowp_pair(
        dtype,
        device,
        lambda params: torch.optim.AdamW(
            params, lr=torch.tensor(1e-2, device=device), weight_decay=0.1
        ),
        lambda params: torch.optim.AdamW(
            params, lr=torch.tensor(1e-2, device=device), weight_decay=0.1, fused=True
        ),
    )
    ours_sched = torch.optim.lr_scheduler.StepLR(ours.optimizer, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        x = torch.randn(6, 16, dtype=dtype, device=device)
        mode = _Ops()
        with mode:
            mean_square(ours, x).backward()
            ours.optimizer.step()
        assert "leanddp.adam_step_.default" in mode.names, (
            "the dispatch mode did not see the in-backward step (ops from the autograd thread)"
        )
        assert "aten._local_scalar_dense.default" not in mode.names, (
            "a training step read a tensor on the host (.item()/float())"
        )
        mean_square(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours_sched.step()
        ref_sched.step()
        assert_within_ulps(
            ours.module, ref.module, dtype, f"tensor lr step {step}", *ulp_tolerance(device)
        )
    assert isinstance(ours.optimizer.param_groups[0]["lr"], torch.Tensor)


def _all(rank: int, world_size: int, device: str = "cpu") -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for name in ("adamw", "adam", "sgd"):
            _parity(rank, dtype, name, 1, device)
    _parity(rank, torch.bfloat16, "adamw", 3, device)  # no_sync accumulation
    _grad_scaler(rank, device)
    _tensor_lr(rank, device)
    dist.barrier()


def test_low_precision_grad_scaler_and_tensor_lr_match_torch() -> None:
    run_ranks(2, _all)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_low_precision_on_the_gpu_matches_torch() -> None:
    """The CUDA kernels against torch's fused CUDA optimizers, NCCL at world size 1."""
    run_ranks(1, _all, "cuda", backend="nccl")

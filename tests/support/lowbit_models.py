"""Optimizer state held as a tensor subclass, as torchao's low-bit optimizers hold theirs: a
traceable wrapper subclass whose bytes are in inner tensors (8-bit codes and one float32 scale
per block), with no storage of its own, and an optimizer the in-backward fallback steps with it.
No torchao needed: the shape of the state is what leanddp's bookkeeping meets."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

BLOCK = 32  # elements per scale


class Blockwise8bit(Tensor):
    """A float32 tensor stored as int8 codes (absmax-scaled per block of ``BLOCK``) and the
    blocks' float32 scales: ``codes`` and ``scale`` are its inner tensors
    (``__tensor_flatten__``), as in torchao's ``OptimState8bit``."""

    codes: Tensor
    scale: Tensor

    @staticmethod
    def __new__(cls, codes: Tensor, scale: Tensor, shape: torch.Size) -> Blockwise8bit:
        return Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes: Tensor, scale: Tensor, shape: torch.Size) -> None:
        self.codes = codes
        self.scale = scale

    def __tensor_flatten__(self) -> tuple[list[str], list[torch.Size]]:
        return ["codes", "scale"], [self.shape]

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["codes"], inner["scale"], ctx[0])

    @classmethod
    def quantize(cls, x: Tensor) -> Blockwise8bit:
        flat = x.detach().reshape(-1, BLOCK)
        scale = flat.abs().amax(dim=1).clamp_min(1e-12) / 127
        codes = torch.round(flat / scale[:, None]).to(torch.int8)
        return cls(codes, scale, x.shape)

    def dequantize(self) -> Tensor:
        return (self.codes.float() * self.scale[:, None]).reshape(self.shape)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        raise NotImplementedError(f"Blockwise8bit does not implement {func}")

    def __repr__(self) -> str:  # (Tensor's repr would dispatch ops it does not implement)
        return f"Blockwise8bit(shape={tuple(self.shape)})"


class Momentum8bit(torch.optim.Optimizer):
    """SGD with momentum whose momentum buffer is kept 8-bit (``Blockwise8bit``), quantized
    after every update: a stand-in for a low-bit optimizer leanddp's kernels do not step.
    Every parameter's element count must be a multiple of ``BLOCK``."""

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" in state:
                    buf = state["momentum_buffer"].dequantize()
                else:
                    buf = torch.zeros_like(p, dtype=torch.float32)
                buf.mul_(group["momentum"]).add_(p.grad)
                state["momentum_buffer"] = Blockwise8bit.quantize(buf)
                p.add_(buf.to(p.dtype), alpha=-group["lr"])
        return loss


class Quantizable(torch.nn.Module):
    """Two layers whose weights torchao keeps 8-bit (8192 and 4096 elements, multiples of its
    block) and whose biases it keeps plain (fewer than 4096 elements), in ``dtype``."""

    IN = 32

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(self.IN, 256, dtype=dtype)
        self.down = torch.nn.Linear(256, 16, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(x.to(self.up.weight.dtype)))).float()


#: On a GPU, the least fraction of equal codes against torchao (its step compiled by inductor,
#: whose remaining differences from eager float32, see EAGER_NUMERICS, may round a value on a
#: code boundary to the neighbouring code).
CODES_EQUAL = 0.999

#: inductor's switches, by the names torch versions give them, that make its GPU code compute
#: as eager float32 does, as leanddp's CUDA kernel does: no multiply-add fused across operations
#: (``emulate_precision_casts`` turns Triton's fp fusion off) and IEEE division (Triton's ``/`` is
#: otherwise approximate). Without them torchao's compiled GPU step rounds differently often
#: enough that a bfloat16 run moves apart within a few steps.
EAGER_NUMERICS = (
    ("emulate_precision_casts",),
    ("eager_numerics.division_rounding", "emulate_divison_rounding", "emulate_division_rounding"),
)


def inductor_option(dotted: str) -> Any:
    """inductor's config option ``dotted`` (``a.b`` for b in class a), or None if this torch
    has none by that name."""
    from torch._inductor import config

    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def eager_numerics_switches() -> list[str]:
    """The first name of each of EAGER_NUMERICS that this torch has; a torch with none of one
    set raises."""
    chosen = []
    for names in EAGER_NUMERICS:
        found = [n for n in names if inductor_option(n) is not None]
        if not found:
            raise RuntimeError(f"torch {torch.__version__}'s inductor has none of {names}")
        chosen.append(found[0])
    return chosen


def reference_numerics(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Around torchao's reference step on ``device``: on a GPU, inductor's EAGER_NUMERICS
    switched on; on the CPU nothing (inductor's C++ computes leanddp's bits there as it is)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(dict.fromkeys(eager_numerics_switches(), True))


def assert_torchao_state_equal(ours: dict, ref: dict, what: str, exact: bool = True) -> None:
    """Two parameters' states in torchao's format equal: the step, and each moment's codes and
    scales (8-bit) or values (plain), bit for bit, of the same kind; not ``exact`` (a GPU): at
    least CODES_EQUAL of the codes, scales within 2% (a code one step apart moves a moment by
    up to 1.4%, which may be its block's largest), plain moments within 1e-5 relative."""
    from torchao.optim.subclass_8bit import OptimState8bit

    if not exact:
        assert ours.keys() == ref.keys() and float(ours["step"]) == float(ref["step"]), what
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours[key], ref[key]
            assert type(a) is type(b), f"{what} {key}: {type(a).__name__}"
            if isinstance(b, OptimState8bit):
                equal = (a.codes == b.codes).float().mean().item()
                assert equal >= CODES_EQUAL, f"{what} {key}: {equal:.5f} of the codes equal"
                torch.testing.assert_close(a.scale, b.scale, rtol=0.02, atol=1e-12)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
        return

    assert ours.keys() == ref.keys(), f"{what}: keys {list(ours)} against {list(ref)}"
    assert float(ours["step"]) == float(ref["step"]), f"{what}: step"
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = ours[key], ref[key]
        assert type(a) is type(b), f"{what} {key}: {type(a).__name__} against {type(b).__name__}"
        if isinstance(b, OptimState8bit):
            assert a.signed == b.signed and a.block_size == b.block_size, f"{what} {key}"
            assert a.dtype == b.dtype, f"{what} {key}: dtype {a.dtype} against {b.dtype}"
            assert torch.equal(a.codes, b.codes), f"{what} {key}: codes differ"
            assert torch.equal(a.scale, b.scale), f"{what} {key}: scales differ"
        else:
            assert torch.equal(a, b), f"{what} {key}: values differ"


def resume_both_ways(
    rank: int, world_size: int, factory, offload: bool, ours_kwargs: dict | None = None
) -> None:
    """A run that never stops against one resumed at step 2 from the other side's checkpoint:
    torchao's optimizer on torch's DDP loads leanddp's ``optimizer.state_dict()`` (gathered, with
    ``ours_kwargs`` sharding it), leanddp loads torchao's; from there all four runs stay equal bit
    for bit, on each rank's own data, and so do the two leanddp runs' states."""
    from in_backward_models import InBackwardLockStep, round_trip
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.manual_seed(0)
    model = Quantizable()
    torch.manual_seed(1 + rank)
    data = [[torch.randn(6, Quantizable.IN) for _ in range(2)] for _ in range(4)]
    kw = dict(with_scheduler=False, fused_reference=False, offload=offload, ours_kwargs=ours_kwargs)
    whole = InBackwardLockStep(model, factory, **kw)
    for batches in data[:2]:
        whole.step(batches)
    ours_saved = round_trip(whole.ours.optimizer.state_dict())
    ref_saved = round_trip(whole.ref_opt.state_dict())
    kinds = [type(e["exp_avg"]) for e in ours_saved["state"].values()]
    assert kinds.count(OptimState8bit) == 2, f"leanddp's checkpoint is not torchao's: {kinds}"
    model.load_state_dict(whole.ours.module.state_dict())
    resumed = InBackwardLockStep(model, factory, **kw)
    resumed.ref_opt.load_state_dict(ours_saved)  # leanddp -> torchao
    resumed.ours.optimizer.load_state_dict(ref_saved)  # torchao -> leanddp
    for step, batches in enumerate(data[2:], start=2):
        whole.step(batches)
        resumed.step(batches)
        for run_name, run in {"whole": whole, "resumed": resumed}.items():
            for pname, a, b in run.pairs():
                assert torch.equal(a, b), f"{run_name} step {step} {pname}"
        for (pname, a, _), (_, _, b) in zip(whole.pairs(), resumed.pairs(), strict=True):
            assert torch.equal(a, b), f"step {step} {pname}: resumed differs from never stopping"
        never = whole.ours.optimizer.state_dict()["state"]
        for index, entry in resumed.ours.optimizer.state_dict()["state"].items():
            assert_torchao_state_equal(entry, never[index], f"step {step} {index}")

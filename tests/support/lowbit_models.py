"""Optimizer state held as a tensor subclass, as torchao's low-bit optimizers hold theirs: a
traceable wrapper subclass whose bytes are in inner tensors (8-bit codes and one float32 scale
per block), with no storage of its own, and an optimizer the in-backward fallback steps with it.
No torchao needed: the shape of the state is what leanddp's bookkeeping meets."""

from __future__ import annotations

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

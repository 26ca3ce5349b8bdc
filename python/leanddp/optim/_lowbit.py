"""torchao's 8-bit optimizers (``torchao.optim.AdamW8bit`` and ``Adam8bit``) stepped by leanddp's
8-bit kernels (``leanddp.ops.adam8bit_step_``): which optimizers qualify, their settings for the
C++ side, and their state in torchao's format.

The fused optimizer keeps a quantized parameter's moments as uint8 codes and float32 scales in
flat per-bucket buffers; ``optimizer.state`` holds torchao's ``OptimState8bit`` over views of
them (so ``state_dict()`` is torchao's), and a loaded entry (torchao's 8-bit state, or float
moments such as torch's AdamW's) is quantized with torchao's own quantizer where it is not
already in this optimizer's block size. torchao is imported only where an optimizer of its is
in use (it is the ``lowbit`` extra).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._extension import _C

#: The largest block the 8-bit kernels quantize (csrc/ops/optim8_math.h's kMaxQuantBlock).
MAX_BLOCK: int = _C.MAX_QUANT_BLOCK


def _classes() -> dict[type, bool]:
    """torchao's 8-bit Adam classes, each with whether it decouples weight decay (AdamW); empty
    while torchao is not imported (then no optimizer can be one of them)."""
    if "torchao.optim" not in sys.modules and "torchao" not in sys.modules:
        return {}
    try:
        from torchao.optim import Adam8bit, AdamW8bit
    except ImportError:  # a torchao without them
        return {}
    return {AdamW8bit: True, Adam8bit: False}


def is_8bit_class(cls: type) -> bool:
    """Whether ``cls`` is torchao's AdamW8bit or Adam8bit (not a subclass of them)."""
    return cls in _classes()


def decoupled(cls: type) -> bool:
    """Whether ``cls`` (torchao's) decouples weight decay: AdamW8bit."""
    return _classes().get(cls, False)


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """The torchao option set on ``optimizer`` that the 8-bit kernels do not implement, in
    words, or None."""
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return "amsgrad"
    # (torchao rounds stochastically only where it steps bfloat16 parameters)
    bf16 = any(p.dtype == torch.bfloat16 for g in optimizer.param_groups for p in g["params"])
    if bf16 and getattr(optimizer, "bf16_stochastic_round", False):
        return "bf16_stochastic_round (with bfloat16 parameters)"
    block = getattr(optimizer, "block_size", None)
    if not isinstance(block, int) or not 0 < block <= MAX_BLOCK:
        return f"block_size={block!r} (the kernels take blocks of 1 to {MAX_BLOCK} elements)"
    return None


def block_size(optimizer: torch.optim.Optimizer) -> int:
    """torchao's block size of ``optimizer`` (checked by :func:`unsupported`)."""
    return int(optimizer.block_size)  # type: ignore[attr-defined]  # torchao's attribute


@functools.lru_cache(maxsize=8)
def qmaps(device: torch.device) -> tuple[Tensor, Tensor]:
    """torchao's signed and unsigned maps (256 float32 entries each) on ``device``, one pair per
    device, shared by every parameter's state."""
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    return (
        torch.tensor(get_qmap_signed(), dtype=torch.float32, device=device),
        torch.tensor(get_qmap_unsigned(), dtype=torch.float32, device=device),
    )


def _state_class() -> Any:
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit


def is_8bit_state(value: Any) -> bool:
    """Whether ``value`` is torchao's 8-bit state (``OptimState8bit``)."""
    return "torchao" in sys.modules and isinstance(value, _state_class())


def stepped_dtype(spec: _C.StateSpec, param: Tensor) -> torch.dtype:
    """The dtype of the weights the state of ``param`` (of ``spec``) steps, torchao's
    ``OptimState8bit.dtype``: float32 on the host (offload_to_cpu steps float32 masters),
    else the parameter's."""
    return torch.float32 if spec.master else param.dtype


def to_torchao(
    entries: Sequence[tuple[str, Tensor]], spec: _C.StateSpec, param: Tensor
) -> dict[str, Any]:
    """The fused optimizer's entries of ``param`` (``_C.InBackwardOptimizer.state``: codes
    followed by ``<key>.scale`` where quantized) as torchao's state entry: ``OptimState8bit``
    over the codes and scales, which stay views of leanddp's buffers, with the maps of the
    device the state lives on."""
    entry = dict(entries)
    if not spec.quantized or "exp_avg.scale" not in entry:  # (no state yet: a master at most)
        return entry
    maps = qmaps(spec.device)
    cls = _state_class()
    for key, m in (("exp_avg", maps[0]), ("exp_avg_sq", maps[1])):
        scale = entry.pop(f"{key}.scale")
        entry[key] = cls(entry[key], scale, m, key == "exp_avg", dtype=stepped_dtype(spec, param))
    return entry


def load_values(spec: _C.StateSpec, values: Sequence[Any], param: Tensor) -> list[Tensor]:
    """The moments ``values`` (exp_avg, exp_avg_sq: torchao's 8-bit state, or float tensors) as
    ``_C.InBackwardOptimizer.load_state`` takes them for a parameter of ``spec``: both codes
    then both scales where it is quantized (requantized by torchao where the block size
    differs; quantized by torchao where float), else the two moments as float tensors."""
    if not spec.quantized:
        return [v.dequantize() if is_8bit_state(v) else v for v in values]
    cls = _state_class()
    codes, scales = [], []
    for value, signed in zip(values, (True, False), strict=True):
        if not (is_8bit_state(value) and value.block_size == spec.block and value.signed == signed):
            float_value = value.dequantize() if is_8bit_state(value) else value
            dtype = stepped_dtype(spec, param)
            value = cls.zeros(param.shape, signed, spec.block, spec.device, dtype=dtype)
            value.copy_(float_value.to(spec.device))  # torchao's quantizer
        codes.append(value.codes)
        scales.append(value.scale)
    return [*codes, *scales]

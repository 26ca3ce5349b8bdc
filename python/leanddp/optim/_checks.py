"""optimizer_in_backward's checks: what the factory returned, which optimizers the fused kernels
step, and what offload_to_cpu, shard_optimizer_state and grad_scaler need of the parameters.

Every check raises before any state changes (the wrapper's constructor calls them before any
collective), with an error that names the offending parameter or argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from .._extension import _C
from . import _lowbit
from ._facade import base_class, base_class_of

if TYPE_CHECKING:
    from ._link import InBackward

#: The torch classes leanddp's fused kernels step, and the kind (csrc/fused_optimizer.h) they are.
_FUSED_KINDS = {
    torch.optim.SGD: _C.OptimKind.sgd,
    torch.optim.Adam: _C.OptimKind.adam,
    torch.optim.AdamW: _C.OptimKind.adam,
}


def fail(message: str, cls: type[Exception] = ValueError) -> NoReturn:
    """Raises ``cls`` with ``message``, prefixed as every optimizer_in_backward error is."""
    raise cls(f"leanddp.DistributedDataParallel: optimizer_in_backward: {message}")


def build_optimizer(
    factory: Callable[..., torch.optim.Optimizer],
    module: nn.Module,
    trainable: Sequence[tuple[str, nn.Parameter]],
) -> tuple[torch.optim.Optimizer, list[int]]:
    """Calls ``factory(module.parameters())`` and checks what it returns: a torch optimizer
    holding every trainable parameter exactly once and no other parameter that requires a
    gradient. Returns it and, per trainable parameter, the index of its param group."""
    optimizer = factory(module.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        fail(
            f"the factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}",
            TypeError,
        )
    index = {id(p): i for i, (_, p) in enumerate(trainable)}
    names = {id(p): n for n, p in module.named_parameters()}
    group_of = [-1] * len(trainable)
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            i = index.get(id(p))
            if i is None:
                if p.requires_grad:
                    fail(
                        f"the optimizer holds parameter {names.get(id(p), '(not in the module)')!r}"
                        ", which DistributedDataParallel does not train (it would never be "
                        "stepped); build the optimizer over the wrapped module's parameters"
                    )
                continue
            if group_of[i] >= 0:
                fail(f"parameter {trainable[i][0]!r} is in more than one param group")
            group_of[i] = g
    missing = [trainable[i][0] for i, g in enumerate(group_of) if g < 0]
    if missing:
        fail(
            f"the optimizer does not hold parameter {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: every parameter "
            "that requires a gradient must be optimized (freeze the others with "
            "requires_grad_(False) before wrapping)"
        )
    return optimizer, group_of


#: What the fused kernels step, in words (the errors that refuse another optimizer).
FUSED_WORDS = (
    "torch.optim.SGD, Adam and AdamW (without amsgrad or differentiable) and torchao's AdamW8bit "
    "and Adam8bit (without amsgrad, without bf16_stochastic_round on bfloat16 parameters, "
    f"block_size at most {_lowbit.MAX_BLOCK})"
)


def _kind_of_class(cls: type) -> _C.OptimKind | None:
    if _lowbit.is_8bit_class(cls):
        return _C.OptimKind.adam8bit
    return _FUSED_KINDS.get(cls)


def fused_kind(optimizer: torch.optim.Optimizer | type) -> _C.OptimKind | None:
    """The kind (``_C.OptimKind``) when leanddp's fused kernels can step this optimizer (or
    class), else None."""
    if isinstance(optimizer, type):
        return _kind_of_class(base_class_of(optimizer))
    kind = _kind_of_class(base_class(optimizer))
    if kind == _C.OptimKind.adam8bit:
        return None if _lowbit.unsupported(optimizer) else kind
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("amsgrad"):
            return None
    return kind


def check_fused(
    optimizer: torch.optim.Optimizer,
    trainable: Sequence[tuple[str, nn.Parameter]],
    what: str,
    contiguous: bool,
) -> None:
    """``what`` (offload_to_cpu, shard_optimizer_state) steps every parameter with the fused
    kernels: raises a ValueError naming what they cannot step (before any state changes).
    ``contiguous``: the host steps them (offload_to_cpu), which need contiguous parameters
    (the device's kernels step any dense layout): the rule is ``leanddp._C.state_spec``'s."""
    kind = fused_kind(optimizer)
    if kind is None:
        option = "amsgrad or differentiable"
        if fused_kind(type(optimizer)) == _C.OptimKind.adam8bit:
            option = str(_lowbit.unsupported(optimizer))
        fail(
            f"{what} steps with leanddp's fused kernels, which cover {FUSED_WORDS}; got "
            f"{type(optimizer).__name__}"
            + (f" with {option} set" if fused_kind(type(optimizer)) is not None else "")
        )
    block = _lowbit.block_size(optimizer) if kind == _C.OptimKind.adam8bit else 0
    for name, p in trainable:
        spec = _C.state_spec(kind, p, on_host=contiguous, momentum=False, block=block)
        if spec.unfit == "dtype":
            fail(f"{what} steps {spec.needs} parameters; parameter {name!r} is {p.dtype}")
        if spec.unfit:
            fail(
                f"{what} needs {spec.needs} parameters; parameter {name!r} has strides "
                f"{p.stride()} (make it contiguous before wrapping)"
            )


def check_scaler(scaler: Any, link: InBackward, names: Sequence[str]) -> None:
    """Raises a clear error where the in-backward steps cannot apply ``scaler`` to this
    optimizer's parameters. Which modes a scaler combines with (not offload_to_cpu, for one) is
    ``_C.check_modes``'s rule, which the constructor's argument check applied before."""
    if not scaler.is_enabled():
        return
    if link.kind is None:
        fail(
            "grad_scaler needs an optimizer leanddp's fused kernels step (torch.optim.SGD, "
            f"Adam or AdamW without amsgrad or differentiable); got {link.cls.__name__}"
        )
    if link.kind == _C.OptimKind.adam8bit:
        fail(
            f"grad_scaler: the 8-bit kernels ({link.cls.__name__}) do not unscale gradients; "
            "train in bfloat16 (no scaler), or use torch.optim.AdamW"
        )
    for i, fused in enumerate(link.fused):
        if not fused:
            p = link.params[i]
            needs = link.view.spec(i).needs
            fail(
                f"grad_scaler: parameter {names[i]!r} ({p.dtype}, strides {p.stride()}) is not "
                f"stepped by the fused kernels ({needs} parameters), and a per-bucket Python "
                "step cannot skip an overflowing step without synchronizing"
            )

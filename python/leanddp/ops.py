"""Typed Python wrappers around leanddp's custom ops (``torch.ops.leanddp.*``).

Every op has a CPU and a CUDA kernel, validates all of its arguments before writing anything
(errors name the argument and the list index), and has a fake implementation here so it traces
under FakeTensor and ``torch.compile``. The wrappers are thin: the checks and the work happen in
C++, so the cost per call does not grow with Python work per tensor.

Optimizer ops accept either one flat tensor per argument (a bucket) or lists of tensors with
matching numels, contiguous: float32 parameters and state with float32, bfloat16 or float16
gradients (upcast inside the kernel); or bfloat16/float16 parameters with gradients and state in
their dtype, stepped in float32 math as torch's fused optimizers do. As those, they take
``lr`` as a one-element tensor (read by the kernel: no host synchronization), and GradScaler's
``amp_scale`` (gradients are divided by it) and ``found_inf`` (nonzero: the call does nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._extension import _C  # noqa: F401  (loading it registers torch.ops.leanddp)

TensorOrList = Tensor | Sequence[Tensor]

_flatten_into = torch.ops.leanddp.flatten_into.default
_unflatten_from = torch.ops.leanddp.unflatten_from.default
_adam_step = torch.ops.leanddp.adam_step_.default
_sgd_step = torch.ops.leanddp.sgd_step_.default
_adam8bit_step = torch.ops.leanddp.adam8bit_step_.default


def _as_list(x: TensorOrList | None) -> Sequence[Tensor]:
    if x is None:
        return []
    return [x] if isinstance(x, Tensor) else x


def flatten_into(tensors: Sequence[Tensor], out: Tensor, scale: float | None = None) -> Tensor:
    """Copy ``tensors`` into consecutive slices of the 1-D ``out``, times ``scale`` if given.

    A tensor that already is its own slice of ``out`` (a bucket view) is left in place (scaled
    in place if ``scale`` is given). On CUDA the whole list is one kernel launch.

    Args:
        tensors: of ``out``'s dtype and device, any shapes and strides; element order within a
            slice is ``t.reshape(-1)``'s.
        out: 1-D, at least the tensors' total numel; the rest of it is left alone.
        scale: multiplies every element copied (None: copied as is).

    Returns:
        ``out``.
    """
    _flatten_into(tensors, out, scale)
    return out


def unflatten_from(flat: Tensor, tensors: Sequence[Tensor], scale: float | None = None) -> None:
    """Copy consecutive slices of the 1-D ``flat`` into ``tensors`` in place, times ``scale``.

    The inverse of :func:`flatten_into`.

    Args:
        flat: 1-D, at least the tensors' total numel.
        tensors: written in place; may be non-contiguous views (but not expanded tensors whose
            elements share memory).
        scale: multiplies every element copied (None: copied as is).
    """
    _unflatten_from(flat, tensors, scale)


def adamw_step_(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avg: TensorOrList,
    exp_avg_sq: TensorOrList,
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool = False,
    grad_scale: float | None = None,
    param_copy: TensorOrList | None = None,
    decoupled_weight_decay: bool = True,
    state_steps: TensorOrList | None = None,
    amp_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    tail_from: list[int] | None = None,
) -> None:
    """One ``torch.optim.AdamW`` step, in place, fused into a single pass over memory.

    On the CPU the last ``numel % (32 bytes / element size)`` elements of each parameter take the
    arithmetic of torch's scalar tail loop, so results equal torch's fused kernel bit for bit.

    Args:
        params: updated in place (a flat bucket, or a list).
        grads: matching ``params``; not modified.
        exp_avg: the first moments, updated in place.
        exp_avg_sq: the second moments, updated in place.
        lr: the learning rate, or a one-element float32/float64 tensor on the parameters'
            device (read by the kernel: no host synchronization).
        beta1: torch's ``betas[0]``.
        beta2: torch's ``betas[1]``.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW), or L2 with ``decoupled_weight_decay=False``.
        step: the 1-based number of this update (torch's ``state["step"]`` after its
            increment).
        maximize: ascend instead of descend, as torch's ``maximize``.
        grad_scale: multiplies every gradient first (averaging, a clipping coefficient).
        param_copy: bfloat16/float16 tensors matching ``params`` that receive the updated
            parameters in the same pass.
        decoupled_weight_decay: False gives Adam's L2 weight decay (see :func:`adam_step_`).
        state_steps: one float32 scalar tensor per parameter, on their device, already
            counting this update; replaces ``step``.
        amp_scale: GradScaler's scale: divides the gradients (after ``grad_scale``).
        found_inf: nonzero: the call does nothing (GradScaler's overflow flag).
        tail_from: one index per parameter: where torch's scalar tail starts in a parameter
            that is a piece of a larger tensor (the larger tensor's tail, relative to the
            piece).
    """
    lr_tensor = lr if isinstance(lr, Tensor) else None
    _adam_step(
        _as_list(params),
        _as_list(grads),
        _as_list(exp_avg),
        _as_list(exp_avg_sq),
        _as_list(param_copy),
        lr=0.0 if lr_tensor is not None else lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        grad_scale=grad_scale,
        state_steps=_as_list(state_steps),
        lr_tensor=lr_tensor,
        amp_scale=amp_scale,
        found_inf=found_inf,
        tail_from=tail_from,
    )


def adam_step_(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avg: TensorOrList,
    exp_avg_sq: TensorOrList,
    **hyper: Any,
) -> None:
    """One ``torch.optim.Adam`` step (L2 weight decay added to the gradient), in place.

    Args:
        params: as in :func:`adamw_step_`.
        grads: as in :func:`adamw_step_`.
        exp_avg: as in :func:`adamw_step_`.
        exp_avg_sq: as in :func:`adamw_step_`.
        hyper: :func:`adamw_step_`'s keyword arguments, but ``decoupled_weight_decay``.
    """
    adamw_step_(params, grads, exp_avg, exp_avg_sq, decoupled_weight_decay=False, **hyper)


def sgd_step_(
    params: TensorOrList,
    grads: TensorOrList,
    momentum_buffer: TensorOrList | None,
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float | None = None,
    first_step: bool = False,
    param_copy: TensorOrList | None = None,
    amp_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One ``torch.optim.SGD`` step, in place.

    Args:
        params: updated in place (a flat bucket, or a list).
        grads: matching ``params``; not modified.
        momentum_buffer: updated in place; None (or empty) when ``momentum`` is 0.
        lr: the learning rate, or a one-element tensor as in :func:`adamw_step_`.
        momentum: torch's ``momentum``.
        dampening: torch's ``dampening``.
        nesterov: torch's ``nesterov``.
        weight_decay: L2, added to the gradient.
        maximize: ascend instead of descend.
        grad_scale: as in :func:`adamw_step_`.
        first_step: the buffer holds no history yet: it is set to the gradient, as torch does
            when its ``momentum_buffer`` is None, instead of being blended.
        param_copy: as in :func:`adamw_step_`.
        amp_scale: as in :func:`adamw_step_`.
        found_inf: as in :func:`adamw_step_`.
    """
    lr_tensor = lr if isinstance(lr, Tensor) else None
    _sgd_step(
        _as_list(params),
        _as_list(grads),
        _as_list(momentum_buffer),
        _as_list(param_copy),
        lr=0.0 if lr_tensor is not None else lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
        first_step=first_step,
        grad_scale=grad_scale,
        lr_tensor=lr_tensor,
        amp_scale=amp_scale,
        found_inf=found_inf,
    )


def adam8bit_step_(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avg: TensorOrList,
    exp_avg_sq: TensorOrList,
    exp_avg_scale: TensorOrList,
    exp_avg_sq_scale: TensorOrList,
    qmap_signed: Tensor,
    qmap_unsigned: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled_weight_decay: bool = True,
    grad_scale: float | None = None,
    param_copy: TensorOrList | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One step of torchao's block-wise 8-bit ``AdamW8bit`` (or ``Adam8bit``), in place.

    The moments of a parameter are either 8-bit (``exp_avg[i]`` and ``exp_avg_sq[i]`` uint8 codes
    shaped like the contiguous parameter, ``exp_avg_scale[i]`` and ``exp_avg_sq_scale[i]`` one
    float32 scale per block of ``numel // scale.numel()`` elements, at most 4096) or plain (the
    parameter's dtype and layout, with empty scale tensors): torchao keeps the moments of
    parameters under 4096 elements or not a multiple of the block plain. The update and the
    requantization follow torchao's ``single_param_adam`` (see ``csrc/ops/optim8_math.h``), with
    its ``amsgrad`` and ``bf16_stochastic_round`` off (neither is implemented). Not capturable
    in a CUDA graph.

    Args:
        params: updated in place (a flat tensor, or a list): float32 (``grads`` float32, bfloat16
            or float16), or bfloat16/float16 with ``grads`` of their dtype.
        grads: matching ``params``; not modified.
        exp_avg: codes through ``qmap_signed``, or plain state; updated in place.
        exp_avg_sq: codes through ``qmap_unsigned``, or plain state; updated in place.
        exp_avg_scale: the scales of ``exp_avg`` (empty for plain state); updated in place.
        exp_avg_sq_scale: the scales of ``exp_avg_sq``; updated in place.
        qmap_signed: torchao's signed map (256 float32 entries, the ``qmap`` of its
            ``OptimState8bit``), on the parameters' device.
        qmap_unsigned: torchao's unsigned map.
        lr: the learning rate (rounded to float32, as torchao keeps it).
        beta1: torchao's ``betas[0]``.
        beta2: torchao's ``betas[1]``.
        eps: torchao's ``eps``.
        weight_decay: decoupled (AdamW) or added to the gradient (Adam).
        step: the 1-based count of this update.
        decoupled_weight_decay: True for ``AdamW8bit``, False for ``Adam8bit``.
        grad_scale: multiplies every gradient (global-norm clipping's coefficient).
        param_copy: as in :func:`adamw_step_`.
        found_inf: a one-element float32 tensor on the parameters' device; nonzero: no step.
    """
    _adam8bit_step(
        _as_list(params),
        _as_list(grads),
        _as_list(exp_avg),
        _as_list(exp_avg_sq),
        _as_list(exp_avg_scale),
        _as_list(exp_avg_sq_scale),
        _as_list(param_copy),
        qmap_signed,
        qmap_unsigned,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled_weight_decay=decoupled_weight_decay,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


# Fake implementations: every op mutates its arguments in place and returns nothing, so under
# FakeTensor there is no output to describe.
@torch.library.register_fake("leanddp::flatten_into")  # type: ignore[untyped-decorator]  # unannotated in torch
def _flatten_into_fake(tensors: list[Tensor], out: Tensor, scale: float | None = None) -> None:
    return None


@torch.library.register_fake("leanddp::unflatten_from")  # type: ignore[untyped-decorator]  # unannotated in torch
def _unflatten_from_fake(flat: Tensor, tensors: list[Tensor], scale: float | None = None) -> None:
    return None


@torch.library.register_fake("leanddp::adam_step_")  # type: ignore[untyped-decorator]  # unannotated in torch
def _adam_step_fake(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    param_copy: list[Tensor],
    **kwargs: Any,
) -> None:
    return None


@torch.library.register_fake("leanddp::sgd_step_")  # type: ignore[untyped-decorator]  # unannotated in torch
def _sgd_step_fake(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffer: list[Tensor],
    param_copy: list[Tensor],
    **kwargs: Any,
) -> None:
    return None


@torch.library.register_fake("leanddp::adam8bit_step_")  # type: ignore[untyped-decorator]  # unannotated in torch
def _adam8bit_step_fake(*args: Any, **kwargs: Any) -> None:
    return None

"""optimizer_in_backward's clipping guard: torch's clipping functions raise on its parameters.

By the time user code could clip, the gradients of in-backward parameters were stepped and
released inside backward; clipping nothing would silently train unclipped. (Exact global-norm
clipping is ``max_grad_norm``, done by the Reducer.)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

_GUARDED: dict[int, weakref.ref[nn.Parameter]] = {}
#: The clipping functions of torch.nn.utils.clip_grad that take parameters (clip_grad_norm and
#: torch.nn.utils.clip_grads_with_norm_ call these at call time).
_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_", "_clip_grads_with_norm_")


def guard_clipping(params: Sequence[nn.Parameter]) -> None:
    """Makes torch.nn.utils' clipping functions raise when given these parameters: with
    optimizer_in_backward their gradients were stepped and released inside backward, and
    clipping nothing would silently train unclipped.

    The guard goes inside the function objects themselves, so that a reference taken before
    wrapping (``from torch.nn.utils import clip_grad_norm_``) is guarded too: torch's clipping
    functions are ``_no_grad`` wrappers that look up the function they wrap in a closure cell
    at call time, and that cell is pointed at the guarded function. Where a torch version
    builds them otherwise, the module attributes are replaced instead; clip_grad_norm_ then
    stays guarded through ``_clip_grads_with_norm_``, which it looks up at call time."""
    for p in params:
        key = id(p)

        def forget(_: weakref.ref[nn.Parameter], key: int = key) -> None:
            _GUARDED.pop(key, None)

        _GUARDED[key] = weakref.ref(p, forget)
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in _CLIP_FUNCTIONS:
        fn = getattr(clip_grad, name, None)
        if fn is None or _guard_inside(fn, name):
            continue
        guarded = _guarded(fn, name)  # torch changed its wrappers: replace the attributes
        for module in (utils, clip_grad):
            for attr in (name, name.lstrip("_")):
                if getattr(module, attr, None) is fn:
                    setattr(module, attr, guarded)


def _guard_inside(fn: Callable[..., Any], name: str) -> bool:
    """Points the closure cell holding the function a ``_no_grad`` wrapper calls at a guarded
    version of it; False if ``fn`` is not built that way."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    cells = [
        c
        for var, c in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=True)
        if var == "func" and callable(c.cell_contents)
    ]
    if len(cells) != 1:
        return False
    if not getattr(cells[0].cell_contents, "_leanddp_guard", False):
        cells[0].cell_contents = _guarded(cells[0].cell_contents, name.lstrip("_"))
    return True


def _guarded(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        for p in params:
            ref = _GUARDED.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"torch.nn.utils.{name}: these parameters are trained by leanddp's "
                    "optimizer_in_backward, which steps each bucket inside backward and "
                    "releases its gradients: there is nothing left to clip, and clipping here "
                    "would silently do nothing. For exact global-norm clipping use "
                    "offload_to_cpu=True with max_grad_norm=...; or train without "
                    "optimizer_in_backward (see docs/ddp.md, 'Gradient clipping')."
                )
        return fn(params, *args, **kwargs)

    wrapper._leanddp_guard = True  # type: ignore[attr-defined]
    return wrapper

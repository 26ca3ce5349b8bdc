"""optimizer_in_backward's facade: the user's optimizer as ``ddp.optimizer``.

Its class is swapped for a subclass of its own class (one per class, made once), so
``isinstance`` holds and ``param_groups`` stay the live hyper-parameters an LR scheduler
changes. The subclass's ``step()`` steps nothing (every bucket was stepped inside backward) and
makes the steps' updates visible; its ``state`` property refreshes the views of the fused state;
its ``state_dict()`` is torch's format (gathered first with shard_optimizer_state); and load
hooks copy a loaded state into the fused buffers. The facade reaches the rest through the
``InBackward`` link kept in the instance's ``__dict__``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from ._link import InBackward

_FACADES: dict[type, type] = {}


def base_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The user's class of ``optimizer``, whether or not it is a facade yet."""
    return cast("type[torch.optim.Optimizer]", base_class_of(type(optimizer)))


def base_class_of(cls: type) -> type:
    """``cls``, or the class a facade class was made for."""
    return cls.__bases__[0] if getattr(cls, "_leanddp_in_backward", False) else cls


def _facade_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """Steps nothing: with optimizer_in_backward every bucket is stepped inside backward. A
    closure, if given, is evaluated (it runs forward and backward, which step). Then makes the
    steps' updates visible, so that code reading the parameters after ``step()`` (an EMA, a
    norm, a copy of ``parameters()``) sees them, as after torch's step: with offload_to_cpu the
    host waits for the host steps and the copies back and raises an error a host step met; on
    a GPU without it the current stream is ordered after the steps (the host does not wait).

    Called by ``GradScaler.step`` (which set ``self.found_inf``, this class advertising
    ``_step_supports_amp_scaling``): hands the scaler this iteration's device-side found_inf,
    which ``scaler.update()`` then reads."""
    if "found_inf" in self.__dict__:
        link: InBackward | None = self.__dict__.get("_leanddp_link")
        scaler = link.scaler if link is not None else None
        if scaler is None or link is None or link.found_inf is None:
            raise RuntimeError(
                "leanddp optimizer_in_backward: GradScaler.step(ddp.optimizer) was called, but "
                "the gradients were stepped inside backward without the scaler: pass "
                "grad_scaler=<the GradScaler> to leanddp.DistributedDataParallel"
            )
        state = scaler._per_optimizer_states[id(self)]
        state["found_inf_per_device"] = {link.found_inf.device: link.found_inf}
    result = None
    if closure is not None:
        with torch.enable_grad():
            result = closure()
    link = self.__dict__.get("_leanddp_link")
    if link is not None:
        link.wait_for_steps()
    return result


def _facade_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's ``state_dict()``. With shard_optimizer_state the state is first gathered from
    every rank's shard: a collective, so every rank calls it (at the same point of the loop),
    and every rank gets the whole state, loadable by the plain torch optimizer."""
    link = self.__dict__.get("_leanddp_link")
    base = base_class(self)
    if link is None or not link.sharded:
        return base.state_dict(self)
    held = self.__dict__["state"]
    link.loading = True  # optimizer.state is the gathered one for the moment
    try:
        self.__dict__["state"] = collections.defaultdict(dict, link.gathered_state())
        return base.state_dict(self)
    finally:
        self.__dict__["state"] = held
        link.loading = False


def _facade_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """torch's ``zero_grad()``; with accumulate_on_host also drops the gradients of the
    ``no_sync()`` micro-batches summed on the host (which ``param.grad`` does not hold)."""
    base_class(self).zero_grad(self, set_to_none)
    link = self.__dict__.get("_leanddp_link")
    reducer = link.reducer if link is not None else None
    if reducer is not None:
        reducer.discard_host_gradients()


def _facade_add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    raise NotImplementedError(
        "leanddp optimizer_in_backward: parameter groups cannot be added after wrapping; build "
        "the optimizer with all its groups in the factory"
    )


def _facade_state_get(self: torch.optim.Optimizer) -> Any:
    link = self.__dict__.get("_leanddp_link")
    if link is not None:
        link.sync_state()
    return self.__dict__["state"]


def _facade_state_set(self: torch.optim.Optimizer, value: Any) -> None:
    self.__dict__["state"] = value


def make_facade(optimizer: torch.optim.Optimizer, link: InBackward) -> None:
    """Makes ``optimizer`` the facade, linked to ``link`` (see the module doc)."""
    cls = base_class(optimizer)
    if cls not in _FACADES:
        _FACADES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_leanddp_in_backward": True,
                "_step_supports_amp_scaling": True,  # GradScaler.step: see _facade_step
                "step": _facade_step,
                "zero_grad": _facade_zero_grad,
                "add_param_group": _facade_add_param_group,
                "state_dict": _facade_state_dict,
                "state": property(_facade_state_get, _facade_state_set),
            },
        )
    optimizer.__class__ = _FACADES[cls]
    optimizer.__dict__["_leanddp_link"] = link
    optimizer.register_load_state_dict_pre_hook(_before_load)
    optimizer.register_load_state_dict_post_hook(_after_load)


def _before_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    link = optimizer.__dict__.get("_leanddp_link")
    if link is not None:
        link.loading = True
        link.saved = _saved_tensors(optimizer, link.params, state_dict)


def _saved_tensors(
    optimizer: torch.optim.Optimizer, params: list[Any], state_dict: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """The tensors of ``state_dict``'s state as saved, per index into ``params``, before torch's
    load casts them to their parameter's dtype (which would round the float32 master weights
    and moments offload_to_cpu keeps for bfloat16/float16 parameters). Parameters are matched
    as torch's load matches them: the saved groups' ids in order, to the groups' parameters in
    order (a mismatch is torch's error, raised after this hook)."""
    try:
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        entries = state_dict["state"].items()
    except (KeyError, TypeError, AttributeError):
        return {}
    current = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    param_of = dict(zip(saved_ids, current, strict=False))
    out = {}
    for k, entry in entries:
        p = param_of.get(k)
        if p is not None and id(p) in index and isinstance(entry, dict):
            out[index[id(p)]] = {key: v for key, v in entry.items() if isinstance(v, torch.Tensor)}
    return out


def _after_load(optimizer: torch.optim.Optimizer) -> None:
    link = optimizer.__dict__.get("_leanddp_link")
    if link is not None:
        link.load_state()

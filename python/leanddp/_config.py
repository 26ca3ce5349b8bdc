"""The DDP constructor's arguments: checked once, before any collective, into a DDPConfig."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._extension import _C

#: torch's default bucket cap, in MiB.
DEFAULT_BUCKET_CAP_MB = 25
#: With the default cap, the first bucket is capped at 1 MiB so reduction starts early (as in
#: torch's DDP, an explicit ``bucket_cap_mb`` caps every bucket, the first one included).
FIRST_BUCKET_BYTES = 1024 * 1024
#: A cap no bucket reaches: every parameter of a (device, dtype) in one bucket.
_UNCAPPED = 2**63 - 1
_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """What a leanddp.DistributedDataParallel was built with, after checking."""

    process_group: dist.ProcessGroup | None
    """The group gradients are averaged over (the default group if none was given)."""
    device: torch.device
    """The one device holding every trainable parameter."""
    device_ids: list[int] | None
    """torch's ``device_ids``: for a CUDA module, ``[its device index]`` or None; inputs are
    moved to that device before the forward when given."""
    output_device: int | None
    """Accepted for compatibility; outputs stay where the module puts them."""
    dim: int
    """Accepted for compatibility (single-device modules do not scatter)."""
    init_sync: bool
    """Verify parameters across ranks and broadcast module state from rank 0 at construction."""
    init_sync_buffers: bool
    """Whether that construction-time broadcast includes buffers."""
    forward_sync_buffers: bool
    """Broadcast buffers from rank 0 before each forward (``broadcast_buffers``)."""
    caps_bytes: tuple[int, ...]
    """Byte caps of consecutive buckets (the last repeats)."""
    initial_caps_bytes: tuple[int, ...]
    """The caps of the layout before the first rebuild, torch's DDP's: every parameter of a
    (device, dtype) in one bucket, unless ``find_unused_parameters`` without ``static_graph``
    or ``bucket_cap_mb_list`` keep ``caps_bytes``; ``optimizer_in_backward`` keeps them too, so
    that bucket memory is bounded in the first iteration as well."""
    find_unused_parameters: bool
    """Search each forward's graph for parameters it does not reach."""
    gradient_as_bucket_view: bool
    """``param.grad`` is a view into its bucket (default True)."""
    static_graph: bool
    """The used parameters are the same every iteration."""
    batched_grad_copy: bool
    """Accepted for compatibility: leanddp always copies a bucket's gradients in one pass."""
    ignored_names: tuple[str, ...]
    """Names in ``module._ddp_params_and_buffers_to_ignore``: neither synced nor reduced."""
    optimizer_in_backward: Callable[..., torch.optim.Optimizer] | None = None
    """Factory of the optimizer stepped bucket by bucket inside backward (None: off)."""
    offload_to_cpu: bool = False
    """Optimizer state and float32 master weights in host memory, stepped there by a worker."""
    max_grad_norm: float | None = None
    """offload_to_cpu or shard_optimizer_state: clip the gradients' global 2-norm to this, as
    ``clip_grad_norm_`` would."""
    offload_threads: int = 1
    """offload_to_cpu: threads of the host optimizer step."""
    accumulate_on_host: bool = False
    """offload_to_cpu: no_sync() micro-batches' gradients are summed in host memory, each
    bucket released from the device once complete (default with offload_to_cpu)."""
    sparse_names: tuple[str, ...] = ()
    """Trainable parameters whose gradients are sparse tensors (torch's rule: parameters of
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``): each is reduced on its own as a
    sparse tensor, never a bucket view."""
    shard_optimizer_state: bool = False
    """optimizer_in_backward: each rank keeps and steps only its shard of every bucket's
    optimizer state; buckets are reduce-scattered and the stepped shards all-gathered."""
    check_for_nan_in_grad: bool | str = False
    """Raise on every rank, at the end of backward, if a reduced gradient holds NaN or inf:
    True, or ``"strict"`` (with optimizer_in_backward on the device, the steps then wait for the
    end of backward, so a NaN changes no weight)."""
    modes: Any = None
    """The combination of modes the arguments asked for (a ``_C.Modes``), which
    ``_C.check_modes`` accepted at construction; ``register_comm_hook`` asks it again with a
    hook."""

    def reducer_options(
        self, param_names: Sequence[str], shard_blocks: tuple[int, Sequence[str]] = (1, ())
    ) -> _C.ReducerOptions:
        """The C++ Reducer's settings (``_C.ReducerOptions``) for the trainable parameters
        ``param_names``: the one place each of this configuration's settings reaches it.
        ``shard_blocks``: the in-backward optimizer's block size and the parameters it
        quantizes by blocks (8-bit state, sharded), whose shard cuts fall on block boundaries."""
        from ._extension import _C

        options = _C.ReducerOptions()
        options.caps_bytes = list(self.caps_bytes)
        options.initial_caps_bytes = list(self.initial_caps_bytes)
        options.gradient_as_bucket_view = self.gradient_as_bucket_view
        options.find_unused_parameters = self.find_unused_parameters
        options.static_graph = self.static_graph
        options.optimizer_in_backward = self.optimizer_in_backward is not None
        options.sparse_names = [name for name in param_names if name in set(self.sparse_names)]
        options.nan_check = _nan_check(self.check_for_nan_in_grad)
        options.shard_optimizer_state = self.shard_optimizer_state
        options.shard_block, options.shard_block_names = shard_blocks[0], list(shard_blocks[1])
        options.accumulate_on_host = self.accumulate_on_host
        options.max_grad_norm = self.max_grad_norm
        return options

    def without_group(self) -> DDPConfig:
        """A picklable copy (process groups do not pickle)."""
        return dataclasses.replace(self, process_group=None)

    def with_group(self, group: dist.ProcessGroup) -> DDPConfig:
        return dataclasses.replace(self, process_group=group)


_UNSUPPORTED = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "skip_all_reduce_unused_params": False,
}


def default_offload_threads() -> int:
    """The host step's threads by default: this process's share of the CPUs it may run on
    (torchrun's LOCAL_WORLD_SIZE processes share a machine)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cpus // local)


def _check_accumulate_on_host(kw: dict[str, Any]) -> bool:
    value = kw["accumulate_on_host"]
    if value is not None and not isinstance(value, bool):
        _fail(f"accumulate_on_host must be a bool or None, got {value!r}", TypeError)
    offload: bool = kw["offload_to_cpu"]  # (a bool: _check_offload ran first)
    return offload if value is None else value


def _check_offload(kw: dict[str, Any]) -> tuple[bool, float | None, int]:
    offload, max_norm, threads = kw["offload_to_cpu"], kw["max_grad_norm"], kw["offload_threads"]
    if not isinstance(offload, bool):
        _fail(f"offload_to_cpu must be a bool, got {offload!r}", TypeError)
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            _fail(f"max_grad_norm must be a number, got {max_norm!r}", TypeError)
        if not (math.isfinite(max_norm) and max_norm > 0):
            _fail(f"max_grad_norm must be positive and finite, got {max_norm!r}")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0
    ):
        _fail(f"offload_threads must be a positive int or None, got {threads!r}")
    return (
        offload,
        None if max_norm is None else float(max_norm),
        (threads if threads is not None else default_offload_threads()),
    )


def _nan_check(value: bool | str) -> _C.NanCheck:
    """``check_for_nan_in_grad`` (False, True or "strict") as a ``_C.NanCheck``."""
    from ._extension import _C

    if value == "strict":
        return _C.NanCheck.strict
    return _C.NanCheck.on if value else _C.NanCheck.off


def _requested_modes(kw: dict[str, Any], sparse_names: Sequence[str]) -> Any:
    """The combination of modes the arguments ``kw`` ask for (each argument of the right type),
    with the module's parameters ``sparse_names`` that get sparse gradients: a ``_C.Modes``."""
    from ._extension import _C

    scaler = kw["grad_scaler"]
    return _C.Modes(
        optimizer_in_backward=kw["optimizer_in_backward"] is not None,
        offload_to_cpu=kw["offload_to_cpu"],
        shard_optimizer_state=kw["shard_optimizer_state"],
        accumulate_on_host=kw["accumulate_on_host"] is True,
        max_grad_norm=kw["max_grad_norm"] is not None,
        offload_threads=kw["offload_threads"] is not None,
        check_for_nan_in_grad=_nan_check(kw["check_for_nan_in_grad"]),
        grad_scaler=scaler is not None,
        grad_scaler_enabled=scaler is None or scaler.is_enabled(),
        sparse_parameter=sparse_names[0] if sparse_names else "",
    )


def check_modes(modes: Any, cls: type[Exception] = ValueError) -> None:
    """Raises ``cls`` with the message of the first rule of which modes combine that ``modes``
    (a ``_C.Modes``) breaks: the rules are ``_C.check_modes``'s (csrc/modes.h), the one place
    they are written."""
    from ._extension import _C

    error = _C.check_modes(modes)
    if error is not None:
        _fail(error.message, cls)


def _fail(message: str, cls: type[Exception] = ValueError) -> NoReturn:
    raise cls(f"leanddp.DistributedDataParallel: {message}")


def _resolve_group(
    process_group: dist.ProcessGroup | None, device_mesh: DeviceMesh | None
) -> dist.ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError(
            "Cannot specify both process_group and device_mesh arguments. "
            "(leanddp.DistributedDataParallel: pass one of them.)"
        )
    if not dist.is_available() or not dist.is_initialized():
        _fail(
            "no process group: call torch.distributed.init_process_group() first (torchrun "
            "sets the environment it needs), or pass process_group=",
            RuntimeError,
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(
                f"Only 1D device mesh is supported, but got {device_mesh}. "
                f"(leanddp.DistributedDataParallel: device_mesh has {device_mesh.ndim} dimensions.)"
            )
        return device_mesh.get_group()
    if process_group is not None:
        return process_group
    world = dist.group.WORLD
    assert world is not None  # (the default group is initialized: checked above)
    return world


def _caps(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> tuple[int, ...]:
    if bucket_cap_mb_list:
        for i, mb in enumerate(bucket_cap_mb_list):
            if not isinstance(mb, (int, float)) or mb <= 0:
                _fail(f"bucket_cap_mb_list[{i}] must be a positive number of MiB, got {mb!r}")
        return tuple(int(mb * _MB) for mb in bucket_cap_mb_list)
    default = bucket_cap_mb is None
    if default:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        _fail(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}", TypeError)
    if not bucket_cap_mb > 0:
        _fail(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    cap = max(1, int(bucket_cap_mb * _MB))
    return (FIRST_BUCKET_BYTES, cap) if default and cap > FIRST_BUCKET_BYTES else (cap,)


def _check_module(module: Any, ignored: Sequence[str]) -> torch.device:
    if not isinstance(module, nn.Module):
        _fail(f"module must be a torch.nn.Module, got {type(module).__name__}", TypeError)
    trainable = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored
    ]
    if not trainable:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter "
            "that requires a gradient. (leanddp.DistributedDataParallel: the module has no "
            "parameter that requires a gradient, outside _ddp_params_and_buffers_to_ignore, so "
            "there is nothing to synchronize.)"
        )
    for n, p in trainable:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with "
                "`DistributedDataParallel`. Run a dummy forward pass to correctly initialize the "
                f"modules. (leanddp.DistributedDataParallel: parameter {n!r} is uninitialized.)"
            )
    devices = {p.device for _, p in trainable}
    if len({d.type for d in devices}) > 1:
        _fail(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {sorted({d.type for d in devices})}."
        )
    if len(devices) > 1:
        first: dict[torch.device, str] = {}
        for n, p in trainable:
            first.setdefault(p.device, n)
        listed = ", ".join(f"{n!r} on {d}" for d, n in first.items())
        _fail(f"parameters are on several devices ({listed}); leanddp needs one device per rank")
    for n, p in trainable:
        if not (p.is_floating_point() or p.is_complex()):
            _fail(f"parameter {n!r} has dtype {p.dtype}; trainable parameters must be floating")
        if p.layout != torch.strided:
            _fail(f"parameter {n!r} has layout {p.layout}; leanddp needs dense parameters")
    return devices.pop()


def sparse_gradient_names(module: nn.Module, ignored: Sequence[str]) -> tuple[str, ...]:
    """The trainable parameters torch's DDP expects sparse gradients for
    (``_build_params_for_reducer``): those of ``nn.Embedding``/``nn.EmbeddingBag`` modules with
    ``sparse=True``; a parameter shared by several modules counts for the first that holds it."""
    seen: set[int] = set()
    names = []
    for prefix, sub in module.named_modules():
        for local, p in sub.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if not p.requires_grad or name in ignored or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
                names.append(name)
    return tuple(names)


def check_arguments(module: Any, **kw: Any) -> DDPConfig:
    """Validates every constructor argument (raising a clear error naming it) and returns the
    resulting configuration. Performs no collective and changes no state. Each argument's own
    type and range are checked first; then how the modes combine (``check_modes``)."""
    for name, default in _UNSUPPORTED.items():
        if kw[name] != default and kw[name] is not None:
            _fail(f"{name} is not supported", NotImplementedError)
    nan_check = kw["check_for_nan_in_grad"]
    if not (isinstance(nan_check, bool) or nan_check == "strict"):
        _fail(f"check_for_nan_in_grad must be True, False or 'strict', got {nan_check!r}")
    scaler = kw["grad_scaler"]
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        _fail(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}", TypeError)
    factory = kw["optimizer_in_backward"]
    if factory is not None and not callable(factory):
        _fail(
            "optimizer_in_backward must be a callable that takes parameters and returns a "
            f"torch.optim.Optimizer (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), got "
            f"{type(factory).__name__}",
            TypeError,
        )
    offload, max_grad_norm, offload_threads = _check_offload(kw)
    accumulate_on_host = _check_accumulate_on_host(kw)
    for name in (
        "shard_optimizer_state",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "init_sync",
    ):
        if not isinstance(kw[name], bool):
            _fail(f"{name} must be a bool, got {kw[name]!r}", TypeError)
    caps = _caps(kw["bucket_cap_mb"], kw["bucket_cap_mb_list"])
    ignored = tuple(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    device = _check_module(module, ignored)
    sparse_names = sparse_gradient_names(module, ignored)
    modes = _requested_modes(kw, sparse_names)
    check_modes(modes)  # every argument is of the right type: now how they combine
    device_ids = kw["device_ids"]
    if device_ids is not None and len(device_ids) > 1:
        _fail(
            "device_ids can only be None or contain a single element. "
            f"(got device_ids={device_ids!r})"
        )
    if device_ids is not None:
        device_ids = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]
        if device.type == "cpu" or len(device_ids) != 1 or device_ids[0] != device.index:
            _fail(
                f"device_ids={kw['device_ids']!r} does not match the module: pass None for CPU "
                f"modules, or the one device index of a GPU module (its parameters are on "
                f"{device})"
            )
    group = _resolve_group(kw["process_group"], kw["device_mesh"])
    if kw["check_reduction"]:
        warnings.warn("check_reduction is deprecated and has no effect", stacklevel=3)
    broadcast, forward_sync = kw["broadcast_buffers"], kw["forward_sync_buffers"]
    if forward_sync is not None:
        forward_sync_buffers, init_sync_buffers = bool(forward_sync), True
    else:
        forward_sync_buffers = init_sync_buffers = True if broadcast is None else bool(broadcast)
    output_device = kw["output_device"]
    if isinstance(output_device, torch.device):
        output_device = output_device.index
    return DDPConfig(
        process_group=group,
        device=device,
        device_ids=device_ids,
        output_device=output_device,
        dim=kw["dim"],
        init_sync=kw["init_sync"],
        init_sync_buffers=init_sync_buffers,
        forward_sync_buffers=forward_sync_buffers,
        caps_bytes=caps,
        initial_caps_bytes=(
            caps
            if kw["bucket_cap_mb_list"]
            or (kw["find_unused_parameters"] and not kw["static_graph"])
            or factory is not None  # bounded bucket memory from the first iteration on
            else (_UNCAPPED,)
        ),
        find_unused_parameters=kw["find_unused_parameters"],
        gradient_as_bucket_view=kw["gradient_as_bucket_view"],
        static_graph=kw["static_graph"],
        batched_grad_copy=bool(kw["batched_grad_copy"]),
        ignored_names=ignored,
        optimizer_in_backward=factory,
        offload_to_cpu=offload,
        max_grad_norm=max_grad_norm,
        offload_threads=offload_threads,
        accumulate_on_host=accumulate_on_host,
        check_for_nan_in_grad=nan_check,
        sparse_names=sparse_names,
        shard_optimizer_state=kw["shard_optimizer_state"],
        modes=modes,
    )


def check_trainable_unchanged(
    current: Sequence[tuple[str, nn.Parameter]], names: Sequence[str], params: Sequence[Tensor]
) -> None:
    """Raises, naming them, if the module's trainable parameters ``current`` (name, parameter)
    are no longer the wrapped ``params`` (named ``names``), in the same order: parameters were
    added, removed, replaced or frozen since wrapping, so their gradients would silently not be
    reduced. Performs no collective."""
    if len(current) == len(params) and all(
        p is q for (_, p), q in zip(current, params, strict=True)
    ):
        return
    ours = {id(p) for p in params}
    now = {id(p) for _, p in current}
    added = [name for name, p in current if id(p) not in ours]
    gone = [n for n, p in zip(names, params, strict=True) if id(p) not in now]
    what = []
    if added:
        what.append(f"now trains {', '.join(added)} (added or unfrozen)")
    if gone:
        what.append(f"no longer trains {', '.join(gone)} (removed, replaced or frozen)")
    raise RuntimeError(
        "leanddp.DistributedDataParallel: the wrapped module "
        f"{' and '.join(what) or 'trains its parameters in another order'} since it was "
        "wrapped; their gradients would not be reduced as on the other ranks. Change "
        "parameters (or requires_grad) before wrapping the module, then wrap it again."
    )

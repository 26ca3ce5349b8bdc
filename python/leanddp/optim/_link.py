"""optimizer_in_backward's link: ``InBackward`` connects ``ddp.optimizer`` to its C++ side.

It builds the ``_C.InBackwardOptimizer`` (its kind, parameters, groups, the fallback, offload's
settings) and hands it to the Reducer, which gives it every reduced bucket; it pushes the live
hyper-parameters (and GradScaler's scale) before each forward in the fused optimizer's terms, and
keeps ``optimizer.state`` pointed at the fused state (:class:`~leanddp.optim._state.StateView`),
loading checkpoints and adopted entries into it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._extension import _C
from .._stats import storage_bytes
from . import _lowbit
from ._checks import build_optimizer, check_fused, check_scaler, fail, fused_kind
from ._clipping import guard_clipping
from ._facade import base_class, make_facade
from ._fallback import FallbackStepper
from ._state import StateView

if TYPE_CHECKING:
    from .._config import DDPConfig
    from ..ddp import DistributedDataParallel


def _lr(lr: Any, device: torch.device | None) -> float | Tensor:
    """The learning rate for the kernels: a one-element tensor on ``device`` (the kernels read
    it when they run, so the host never waits for it); anything else as a float (a CPU tensor
    read in host memory). ``device`` None: the host steps (offload_to_cpu), which read a tensor
    lr in host memory only; reading one from a GPU would synchronize at every forward."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64):
            fail(f"a tensor lr must have one float32/float64 element, got {lr.dtype} {lr.shape}")
        if device is not None and lr.device == device:
            return lr.reshape(())
        if lr.device.type != "cpu":
            if device is None:
                fail(
                    "with offload_to_cpu the host steps read the learning rate in host memory: "
                    f"a tensor lr must be on the CPU, got {lr.device}"
                )
            fail(
                f"a tensor lr must be on the parameters' device ({device}) or the CPU, got "
                f"{lr.device}"
            )
    return float(lr)


def _hyper(group: dict[str, Any], cls: type, device: torch.device | None = None) -> _C.OptimHyper:
    """A param group's hyper-parameters in the fused optimizer's terms (``device``: where a
    tensor lr may stay a tensor; None: read it as a float)."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    lr = _lr(group["lr"], device)
    return _C.OptimHyper(
        lr=0.0 if isinstance(lr, Tensor) else lr,
        lr_tensor=lr if isinstance(lr, Tensor) else None,
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group.get("eps", 1e-8)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        nesterov=bool(group.get("nesterov", False)),
        maximize=bool(group.get("maximize", False)),
        decoupled=cls is torch.optim.AdamW
        or bool(group.get("decoupled_weight_decay", False))
        or _lowbit.decoupled(cls),
    )


class InBackward:
    """Connects ``ddp.optimizer`` to its C++ side (``_C.InBackwardOptimizer``, :attr:`core`):
    pushes hyper-parameters before each forward, exposes the fused state as
    ``optimizer.state`` and loads checkpoints into it."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        group_of: list[int],
        params: list[nn.Parameter],
        offload: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        names: Sequence[str] | None = None,
        sharded: bool = False,
        offload_threads: int = 1,
        max_grad_norm: float | None = None,
    ) -> None:
        # The wrapper holds the C++ optimizer (which holds the fallback, which holds the torch
        # optimizer, which holds this link): weakly here, so no cycle runs through C++.
        self._ddp = weakref.ref(ddp)
        self._core: weakref.ref[Any] | None = None
        self.optimizer = optimizer
        self.cls = base_class(optimizer)
        self.kind = fused_kind(optimizer)
        self.params = params
        self.group_of = group_of
        #: offload_to_cpu, its threads and clipping
        self.offload = offload
        self.offload_threads = offload_threads
        self.max_grad_norm = max_grad_norm
        names = names or [str(i) for i in range(len(params))]
        self.loading = False  # inside optimizer.load_state_dict(): the state is the loaded one
        # load_state_dict: the state's tensors as saved (uncast), per parameter index
        self.saved: dict[int, dict[str, Any]] = {}
        self.view = StateView(
            optimizer,
            self.kind,
            params,
            names,
            group_of,
            offload,
            sharded,
            block=_lowbit.block_size(optimizer) if self.kind == _C.OptimKind.adam8bit else 0,
        )
        # per parameter: whether the fused kernels step it (else the fallback does)
        self.fused = self.view.fused
        self.device = params[0].device
        if grad_scaler is not None:
            check_scaler(grad_scaler, self, names)
        self.scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.found_inf: Tensor | None = None  # this iteration's (GradScaler)
        on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
        # GradScaler: Adam's step counts live on the device (a skipped step is taken back there).
        on_device = on_device or self.scaler is not None
        self.step_device = str(params[0].device) if on_device and not offload else "cpu"
        self.sharded = sharded
        self.fallback = FallbackStepper(optimizer, self.cls, params, group_of)
        make_facade(optimizer, self)
        guard_clipping(params)

    @classmethod
    def build(
        cls,
        ddp: DistributedDataParallel,
        config: DDPConfig,
        named: Sequence[tuple[str, nn.Parameter]],
        grad_scaler: torch.amp.GradScaler | None,
    ) -> InBackward:
        """The wrapper's construction with optimizer_in_backward: calls the factory
        (``config.optimizer_in_backward``) with ``ddp.module.parameters()``, checks what it
        returns (and, with offload_to_cpu or shard_optimizer_state, that the fused kernels step
        every one of ``named``, the trainable parameters) and links it to ``ddp``. The optimizer
        is the link's ``optimizer``, which becomes ``ddp.optimizer``."""
        assert config.optimizer_in_backward is not None  # (the caller's condition)
        optimizer, group_of = build_optimizer(config.optimizer_in_backward, ddp.module, named)
        if config.offload_to_cpu:
            check_fused(optimizer, named, "offload_to_cpu", contiguous=True)
        if config.shard_optimizer_state:
            check_fused(optimizer, named, "shard_optimizer_state", contiguous=False)
        return cls(
            ddp,
            optimizer,
            group_of,
            [p for _, p in named],
            offload=config.offload_to_cpu,
            grad_scaler=grad_scaler,
            names=[n for n, _ in named],
            sharded=config.shard_optimizer_state,
            offload_threads=config.offload_threads,
            max_grad_norm=config.max_grad_norm,
        )

    @property
    def core(self) -> _C.InBackwardOptimizer | None:
        """The ``_C.InBackwardOptimizer`` (None once the wrapper is gone)."""
        return None if self._core is None else self._core()

    @property
    def reducer(self) -> _C.Reducer | None:
        """The wrapper's Reducer (None once the wrapper is gone)."""
        ddp = self._ddp()
        return None if ddp is None else ddp.reducer

    def attach(
        self, reducer: _C.Reducer, group: dist.ProcessGroup, names: Sequence[str]
    ) -> _C.InBackwardOptimizer:
        """Builds the C++ optimizer over the parameters (``names``, on the process group
        ``group``) and hands it to ``reducer``; state already in ``optimizer.state`` moves into
        it. Returns it, for the wrapper to hold."""
        options = _C.InBackwardOptions()
        options.kind = self.kind
        options.group_of = list(self.group_of)
        options.groups = self._hypers()
        options.step_device = self.step_device
        options.offload_to_cpu = self.offload
        options.offload_threads = self.offload_threads
        options.sharded = self.sharded
        options.max_grad_norm = self.max_grad_norm if self.offload else None
        if self.kind == _C.OptimKind.adam8bit:
            options.block_size = self.view.block
            # (on the host with offload_to_cpu, where the state lives and is stepped)
            options.qmaps = _lowbit.qmaps(torch.device("cpu") if self.offload else self.device)
        core = _C.InBackwardOptimizer(self.params, list(names), group, options, self.fallback)
        reducer.set_optimizer(core)
        self._core = weakref.ref(core)
        self.view.generation = -1
        if self.optimizer.__dict__["state"]:
            self.load_state(core)
        return core

    def wait_for_steps(self) -> None:
        """Makes the last backward's steps visible to the caller (``ddp.synchronize()``): with
        offload_to_cpu the host waits for the host steps and raises an error one met; on a GPU
        the current stream is ordered after the side stream's steps."""
        core = self.core
        if core is not None:
            core.wait_for_steps(host_too=self.offload)

    def _hypers(self) -> list[_C.OptimHyper]:
        device = None if self.offload else self.device  # the host step takes numbers
        if self.kind == _C.OptimKind.adam8bit:
            # torchao keeps lr a CPU tensor, which the kernels take as a number
            for group in self.optimizer.param_groups:
                lr = group["lr"]
                if isinstance(lr, Tensor) and lr.device.type != "cpu":
                    fail(
                        f"{self.cls.__name__} keeps lr a CPU tensor (the 8-bit kernels take it as "
                        f"a number); got one on {lr.device}"
                    )
            device = None
        return [_hyper(g, self.cls, device) for g in self.optimizer.param_groups]

    def before_forward(self, adopt: bool = True) -> None:
        """Makes the current hyper-parameters (and GradScaler's scale) the ones the next
        in-backward steps use, and (``adopt``) :meth:`adopt_state`; without ``adopt`` the
        caller calls it once the last backward's host steps are done (offload_to_cpu: a forward
        that waits for them bucket by bucket)."""
        self.loading = False  # a load_state_dict that raised changed nothing
        self.saved = {}
        core = self.core
        assert core is not None  # (called by the wrapper's forward)
        if self.kind is not None:
            core.set_groups(self._hypers())
        if self.scaler is not None:
            scaler = self.scaler
            if scaler._scale is None:  # what scaler.scale(loss) would do, a step earlier
                scaler._lazy_init_scale_growth_tracker(self.device)
            scale = scaler._scale
            assert scale is not None  # (made just above)
            if scale.device != self.device:
                fail(f"grad_scaler's scale is on {scale.device}, the parameters on {self.device}")
            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
            core.set_grad_scaler(scale, self.found_inf)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # undeclared in torch; LR schedulers: the optimizer does step
        if adopt:
            self.adopt_state()

    def adopt_state(self) -> None:
        """Adopts optimizer state code replaced since the last call, and points
        ``optimizer.state`` at the fused state (waits for the steps where it was created)."""
        if self.kind is not None:
            assert self.core is not None  # (called by the wrapper's forward)
            self.view.adopt(self.core)
        self.sync_state()
        if self.kind is not None:
            self.view.mark()

    def sync_state(self) -> None:
        """Points ``optimizer.state`` at the fused state (after it was created or moved)."""
        core = self.core
        if core is None or self.kind is None or self.loading:
            return
        self.view.sync(core)

    def load_state(self, core: Any = None) -> None:
        """Copies what ``optimizer.state`` holds for fused parameters into the fused state
        (``core``'s, by default the attached one): the tensors as saved, not as torch's load
        cast them (:func:`_facade._saved_tensors`)."""
        self.loading = False
        saved, self.saved = self.saved, {}
        core = core if core is not None else self.core
        if core is None or self.kind is None:
            return
        core.set_groups(self._hypers())  # the loaded groups (momentum on or off)
        self.view.load_all(core, saved)

    def gathered_state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """shard_optimizer_state: every parameter's state in torch's format, gathered from
        every rank's shard (a collective: every rank calls it and gets the whole state)."""
        assert self.core is not None  # (optimizer.state_dict() of a live wrapper's optimizer)
        entries = self.core.gathered_state()
        pairs = enumerate(zip(self.params, entries, strict=True))
        return {p: self.view.entry(i, e) for i, (p, e) in pairs if e}

    def shard_blocks(self) -> tuple[int, list[str]]:
        """shard_optimizer_state with 8-bit state: its block size and the parameters (by name)
        quantized by blocks of it, whose shard cuts must fall on block boundaries
        (``_C.ReducerOptions.shard_block``); else ``(1, [])``."""
        if not self.sharded or self.kind != _C.OptimKind.adam8bit:
            return 1, []
        quantized = [
            self.view.names[i] for i in range(len(self.params)) if self.view.spec(i).quantized
        ]
        return self.view.block, quantized

    def state_bytes(self) -> int:
        """Bytes of optimizer state (fused buffers and fallback state alike; this rank's
        shard of it with shard_optimizer_state)."""
        if self.sharded:
            assert self.core is not None  # (called by the wrapper's memory_stats)
            return int(self.core.memory_stats().state_bytes)
        self.sync_state()
        return storage_bytes(
            value
            for entry in self.optimizer.__dict__["state"].values()
            for key, value in entry.items()
            # (master weights are counted as such, not as state)
            if key != "master_weight" and isinstance(value, Tensor)
        )

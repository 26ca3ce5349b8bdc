"""leanddp.DistributedDataParallel: torch's DDP with leanddp's C++ Reducer as the hot path."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from . import _comm, _lifetime, _rendezvous, _stats, _waits, optim
from ._collectives import sync_buffers, sync_initial_state
from ._config import DDPConfig, check_arguments, check_trainable_unchanged
from ._extension import _C
from ._forward import UnevenInputsHook, after_module, before_module, move_to, warn_replaced_grads
from ._logging import DDPLogger


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """A drop-in ``torch.nn.parallel.DistributedDataParallel`` that stores gradients once.

    Takes torch's constructor arguments, with ``gradient_as_bucket_view=True`` by default:
    ``param.grad`` is a view into the flat bucket that is reduced, so gradients take their
    bytes once. It never builds torch's reducer: hooks, bucketing and the asynchronous
    allreduce run in leanddp's C++ Reducer (``self.reducer``) on the process group given.
    Initialise the process group first; construction broadcasts parameters and buffers from
    rank 0 and checks that every rank holds the same parameters (a collective every rank must
    enter), unless ``init_sync=False``. Bad arguments raise before any collective, naming the
    argument (:class:`DDPConfig` holds what was built, after checking).

    Args:
        module: the module; its trainable parameters must all be on one device and dense,
            or sparse for ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` (reduced as
            torch's DDP reduces them: a bucket of their own, never a view; not with
            ``optimizer_in_backward``).
        device_ids: None for CPU modules; ``[index]`` (or None) for a module on one GPU;
            inputs are then moved to it.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (single-device modules do not scatter).
        broadcast_buffers: as in torch: buffers broadcast from rank 0 before a forward that
            follows a synchronized one.
        init_sync: as in torch: verify and broadcast module state at construction.
        process_group: the group gradients are averaged over (default: the world).
        bucket_cap_mb: bucket cap, as in torch: with the default cap the first bucket is at
            most 1 MiB so reduction starts early; until the first rebuild every parameter of
            a dtype shares one bucket unless ``find_unused_parameters`` (without
            ``static_graph``), ``bucket_cap_mb_list`` or ``optimizer_in_backward`` (whose
            bucket memory stays bounded in the first iteration too).
        find_unused_parameters: as in torch: globally unused parameters keep
            ``grad is None``; locally unused ones get the reduced value.
        check_reduction: accepted for compatibility.
        gradient_as_bucket_view: default **True** here (torch: False).
        static_graph: as in torch (also ``model._set_static_graph()`` before the first step).
        delay_all_reduce_named_params: not supported (``NotImplementedError``).
        param_to_hook_all_reduce: not supported (``NotImplementedError``).
        mixed_precision: torch's DDP mixed precision: not supported
            (``NotImplementedError``).
        device_mesh: a 1-D mesh, instead of ``process_group``.
        skip_all_reduce_unused_params: True is not supported (``NotImplementedError``).
        bucket_cap_mb_list: caps of consecutive buckets, as in torch (the last repeats).
        batched_grad_copy: accepted for compatibility: a bucket's gradients are always copied
            in one pass.
        forward_sync_buffers: torch 2.13's name for ``broadcast_buffers``.
        optimizer_in_backward: a factory such as ``functools.partial(torch.optim.AdamW,
            lr=1e-3)``, called with ``module.parameters()``. Each bucket is then stepped as
            soon as its reduction finishes, still inside backward, and its gradient memory is
            released (``param.grad`` is None afterwards). On a GPU the steps are queued on a
            side stream behind each bucket's reduction, never waited for by the host. The
            optimizer it returns is ``self.optimizer``: LR schedulers and checkpoints use it
            as usual, and its ``step()`` steps nothing but makes the updates visible (with
            ``offload_to_cpu`` it waits for the host steps); ``zero_grad()`` does nothing.
            SGD, Adam and AdamW run on leanddp's fused kernels, any other optimizer through a
            per-bucket fallback.
        offload_to_cpu: with ``optimizer_in_backward``: optimizer state and float32 master
            weights live in host memory; each reduced bucket is copied there, its device
            memory released, and a C++ worker steps it while backward goes on; the updated
            weights are copied back and the next forward waits for each bucket where it first
            reads it.
        max_grad_norm: exact global-norm clipping of each step, equal to
            ``torch.nn.utils.clip_grad_norm_`` before the step; with ``offload_to_cpu`` or
            ``shard_optimizer_state``.
        offload_threads: threads of the host step (default: this process's share of the
            CPUs).
        accumulate_on_host: with ``offload_to_cpu`` (its default there): inside ``no_sync()``
            each bucket's gradients go to host memory as soon as they are complete and the
            bucket is released, so the device holds no gradient between micro-batches; the
            synchronized micro-batch adds the host sum back, bit for bit torch's accumulation.
            ``zero_grad()`` (the wrapper's or ``self.optimizer``'s) drops that sum.
        check_for_nan_in_grad: True: a NaN or infinity in a reduced gradient raises on every
            rank at the end of backward, naming the parameter, before ``optimizer.step()`` can
            run (with ``offload_to_cpu`` no weight changes). ``"strict"``: with
            ``optimizer_in_backward`` on the device, the steps also wait for that check, so
            that no weight changes, holding every gradient bucket until then.
        grad_scaler: the ``torch.amp.GradScaler`` of a float16 loop with
            ``optimizer_in_backward``: its scale must be known before the first bucket's step,
            so it is given here; the loop then calls ``scaler.scale(loss).backward()``,
            ``scaler.step(ddp.optimizer)`` and ``scaler.update()`` as usual. A bucket whose
            gradients overflow, and every bucket stepped after it, is skipped on the device.
            Not with ``offload_to_cpu`` or ``check_for_nan_in_grad``.
        shard_optimizer_state: with ``optimizer_in_backward``: each of the N ranks keeps and
            steps only its 1/N of the optimizer state (and, with ``offload_to_cpu``, of the
            host state and masters); buckets are reduce-scattered and the stepped shards
            all-gathered inside backward.
    """

    # torch's DDP types these as its own C++ Reducer and Logger, which this wrapper never builds
    reducer: _C.Reducer  # type: ignore[assignment]
    logger: DDPLogger  # type: ignore[assignment]
    #: an error the last backward's steps raised, set before the module's forward and raised
    #: after it (``_forward``)
    _step_error: Exception | None

    if TYPE_CHECKING:  # torch's DDP method, unannotated there: logs the error, then raises it

        def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> NoReturn: ...

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        optimizer_in_backward: Callable[..., torch.optim.Optimizer] | None = None,
        offload_to_cpu: bool = False,
        max_grad_norm: float | None = None,
        offload_threads: int | None = None,
        accumulate_on_host: bool | None = None,
        check_for_nan_in_grad: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        shard_optimizer_state: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        config = check_arguments(
            module,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list,
            batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers,
            optimizer_in_backward=optimizer_in_backward,
            offload_to_cpu=offload_to_cpu,
            max_grad_norm=max_grad_norm,
            offload_threads=offload_threads,
            accumulate_on_host=accumulate_on_host,
            check_for_nan_in_grad=check_for_nan_in_grad,
            grad_scaler=grad_scaler,
            shard_optimizer_state=shard_optimizer_state,
        )
        self.module = module
        self._set_config(config)
        if device_mesh is not None:
            self.device_mesh = device_mesh  # torch's attribute
        assert config.process_group is not None  # (check_arguments resolved it)
        self.process_group = config.process_group
        self.optimizer: torch.optim.Optimizer | None = None
        self._in_backward: optim.InBackward | None = None
        # (_build_reducer; optimizer_in_backward only)
        self._optimizer_core: _C.InBackwardOptimizer | None = None
        if config.optimizer_in_backward is not None:
            self._in_backward = optim.InBackward.build(
                self, config, self._named_trainable, grad_scaler
            )
            self.optimizer = self._in_backward.optimizer
        if config.init_sync:
            state: list[Tensor] = [
                p for name, p in module.named_parameters() if name not in self.parameters_to_ignore
            ]
            if config.init_sync_buffers:
                state += self.modules_buffers
            sync_initial_state(
                self._named_trainable, state, self.process_group, config.sparse_names
            )
            # every rank has connected (its data arrived): gloo's rendezvous keys are read no
            # more, and a torchrun restart through the same store must not find them
            _rendezvous.forget_rendezvous_keys(self.process_group)
        self._build_reducer()
        self.logger.set_construction_data(module, config)
        if config.static_graph:
            self.logger._set_static_graph()

    # ----------------------------------------------------------------------------------------
    # construction helpers (_build_reducer runs again when unpickling)

    def _set_config(self, config: DDPConfig) -> None:
        self._config = config
        self.device_ids = config.device_ids
        self.output_device = config.output_device
        self.dim = config.dim
        self.forward_sync_buffers = config.forward_sync_buffers
        self.find_unused_parameters = config.find_unused_parameters
        self.gradient_as_bucket_view = config.gradient_as_bucket_view
        self.static_graph = config.static_graph
        self.bucket_bytes_cap = config.caps_bytes[-1]
        self.batched_grad_copy = config.batched_grad_copy
        self.mixed_precision = None
        self.is_multi_device_module = False
        self.device = config.device
        self.device_type = config.device.type
        self.parameters_to_ignore = set(config.ignored_names)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._join_config = _JoinConfig.construct_disabled_join_config()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._comm_hooks: list[tuple[Callable[..., Any], Any]] = []
        self._warned_replaced_grads = False
        self.logger = DDPLogger()  # torch's _get_ddp_logging_data (dist.Logger's role)

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before each forward (torch's meaning)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)

    @property
    def _has_rebuilt_buckets(self) -> bool:  # type: ignore[override]  # an attribute in torch's DDP
        """torch's attribute: whether the buckets were rebuilt from the observed order."""
        return self.reducer.has_rebuilt_buckets()

    @property
    def _named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [
            (name, p)
            for name, p in self.module.named_parameters()
            if p.requires_grad and name not in self.parameters_to_ignore
        ]

    @property
    def modules_buffers(self) -> list[Tensor]:  # type: ignore[override]  # an attribute in torch's DDP
        """The module's buffers that are synchronized (torch's attribute of the same name)."""
        return [
            b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore
        ]

    def _build_reducer(self) -> None:
        named = self._named_trainable
        self._params = [p for _, p in named]
        self._param_names = [name for name, _ in named]
        self.reducer = _C.Reducer(
            self._params,
            self._param_names,
            self.process_group,
            self._config.reducer_options(
                self._param_names,
                self._in_backward.shard_blocks() if self._in_backward is not None else (1, ()),
            ),
        )
        _lifetime.close_at_end(self, self.reducer)
        self.logger.attach(self.reducer, self._params)
        if self._in_backward is not None:
            #: the C++ in-backward optimizer (``_C.InBackwardOptimizer``), which the Reducer
            #: hands every reduced bucket to; ``self._in_backward`` holds it weakly
            self._optimizer_core = self._in_backward.attach(
                self.reducer, self.process_group, self._param_names
            )
            if getattr(self, "_waits", None) is not None:
                self._waits.remove()
            self._waits: _waits.Waits = _waits.Waits(
                self.module, self._params, self.reducer, self._optimizer_core
            )
        for hook, state in self._comm_hooks:
            self._attach_comm_hook(hook, state)

    # ----------------------------------------------------------------------------------------
    # the training step

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the module; arms the Reducer unless inside ``no_sync()`` or without grad.

        Args:
            inputs: the module's positional arguments (moved to its device with
                ``device_ids``).
            kwargs: the module's keyword arguments (likewise).
        """
        with torch.autograd.profiler.record_function("leanddp.DistributedDataParallel.forward"):
            grad_enabled = torch.is_grad_enabled()
            waits = before_module(self, grad_enabled, torch.compiler.is_compiling())
            if self.device_ids:
                inputs, kwargs = move_to(inputs, kwargs, self.device)
            if waits is None:
                output = self.module(*inputs, **kwargs)
            else:  # offload_to_cpu: each bucket's host step is waited for where it is read
                with waits:
                    output = self.module(*inputs, **kwargs)
            after_module(self, grad_enabled, output, waits is not None)
            return output

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers from rank 0 (torch's rule: only after a
        forward that prepared a synchronized backward, or at the first)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and len(self.modules_buffers) > 0
        )

    def _sync_buffers(self) -> None:
        sync_buffers(self.modules_buffers, self.process_group, self.logger)

    def _check_parameters_unchanged(self) -> None:
        """Raises, naming them, if trainable parameters were added, removed, replaced or
        frozen since wrapping: their gradients would silently not be reduced."""
        check_trainable_unchanged(self._named_trainable, self._param_names, self._params)

    def _warn_replaced_grads(self, names: list[str]) -> None:
        if names and not self._warned_replaced_grads:
            self._warned_replaced_grads = True
            warn_replaced_grads(names, stacklevel=4)

    # ----------------------------------------------------------------------------------------
    # what code written for torch's DDP calls

    def register_comm_hook(
        self, state: object, hook: Callable[..., torch.futures.Future[Any]]
    ) -> None:
        """Replaces the built-in allreduce with ``hook(state, bucket) -> Future`` (torch's
        contract: ``bucket`` is a ``torch.distributed.GradBucket``; torch's own hooks such as
        allreduce, fp16/bf16 compression and PowerSGD work). The hook is checked as torch's DDP
        checks it (TypeError if not callable, ValueError for a ``bucket`` annotation other than
        ``dist.GradBucket`` or a return annotation other than
        ``torch.futures.Future[torch.Tensor]``). Call once, before the first backward.

        Args:
            state: passed to every call of ``hook``.
            hook: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``.
        """
        self._check_comm_hook(hook)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._register_hook(hook, state, getattr(hook, "__qualname__", repr(hook)))

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's built-in hooks: ``dist.BuiltinCommHookType.ALLREDUCE`` (divide by the world
        size, then allreduce) or ``FP16_COMPRESS`` (the same in float16, copied back), on this
        wrapper's process group. Call once, before the first backward."""
        hook = _comm.builtin_hook(comm_hook_type)
        if hook is None:
            self._log_and_throw(
                ValueError,
                f"_register_builtin_comm_hook: unknown comm_hook_type {comm_hook_type!r}; "
                "expected a torch.distributed.BuiltinCommHookType",
            )
        self._register_hook(hook, self.process_group, str(comm_hook_type))

    def _register_hook(self, hook: Callable[..., Any], state: object, name: str) -> None:
        error = _comm.registration_error(bool(self._comm_hooks), self.reducer, self._config.modes)
        if error is not None:
            self._log_and_throw(RuntimeError, error)
        self._attach_comm_hook(hook, state)
        self._comm_hooks.append((hook, state))
        self.logger._set_comm_hook_name(name)

    def _attach_comm_hook(self, hook: Callable[..., Any], state: object) -> None:
        self.reducer.register_comm_hook(
            _comm.make_launcher(hook, state, self._params, self._param_names)
        )

    def _set_static_graph(self) -> None:
        """torch's switch: declares the set of used parameters fixed. Only before the first
        iteration (RuntimeError afterwards, as torch's DDP); warns if already set."""
        if self.static_graph:
            warnings.warn(
                "You've set static_graph to be True, no need to set it again.", stacklevel=2
            )
            return
        if self.logger.num_iterations > 0 or self.reducer.num_iterations() > 0:
            self._log_and_throw(
                RuntimeError,
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed. (leanddp.DistributedDataParallel: "
                "a forward or backward has already run.)",
            )
        self.reducer.set_static_graph()
        self._config = dataclasses.replace(self._config, static_graph=True)
        self.static_graph = True
        self.logger._set_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do not "
                "need to set find_unused_parameters=true, just be sure these unused parameters "
                "will not change during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "leanddp.DistributedDataParallel: _register_fused_optim is not supported; pass "
            "optimizer_in_backward=<optimizer factory> to the constructor instead."
        )

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported yet: raises NotImplementedError (uneven inputs).

        Args:
            args: torch's ``join()`` arguments.
            kwargs: likewise.
        """
        raise NotImplementedError(
            "leanddp.DistributedDataParallel does not support join() (uneven inputs across "
            "ranks) yet. Give every rank the same number of batches, for example with "
            "DistributedSampler(..., drop_last=True)."
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook torch's ``Join`` context asks every joinable for. A disabled context, or
        one that every rank leaves at the same iteration (even inputs), works as with torch's
        DDP; a rank that runs out of inputs first raises NotImplementedError there, as
        :meth:`join` does.

        Args:
            kwargs: torch's ``join_hook()`` arguments (unused).
        """
        return UnevenInputsHook()

    def memory_stats(self) -> dict[str, Any]:
        """Bytes held now: ``param_bytes`` (trainable parameters), ``bucket_bytes`` (flat
        buckets allocated), ``grad_bytes`` (gradients held outside the buckets),
        ``optimizer_state_bytes`` (``self.optimizer``'s state, in ordinary host memory with
        offload_to_cpu; 0 without optimizer_in_backward), ``host_master_bytes`` (float32 master
        weights on the host with offload_to_cpu: ordinary memory for bfloat16/float16
        parameters, the copy-back staging buffer itself for float32 ones),
        ``host_buffer_bytes`` (offload_to_cpu's other staging buffers),
        ``host_accumulation_bytes`` (accumulate_on_host's sums of no_sync() micro-batches) and
        ``host_pinned_bytes`` (how many of those host bytes are pinned: the staging buffers that
        cross PCIe when the model is on a GPU, nothing else); the counts ``grads_as_views``,
        ``grads_outside`` and ``num_buckets``; for the last synchronized backward,
        ``peak_bucket_bytes`` (most bucket bytes held at once: allocated, released but still
        in use on the device, or kept for reuse) and ``max_buckets_in_flight`` (most buckets
        reduced or reducing but not yet stepped, with optimizer_in_backward);
        ``recycled_bucket_bytes`` (released bucket storage kept for the next buckets: with a
        communication hook and optimizer_in_backward on a GPU, whose collectives keep their
        buckets past their release, at most ``buckets in flight + 1`` buffers); and
        ``host_bytes_per_param``: host bytes per trainable parameter by category
        (``optimizer_state``, ``master_weights``, ``staging``, ``accumulation``, ``pinned``; all
        0.0 without offload_to_cpu)."""
        return _stats.memory_stats(
            self.reducer,
            self._params,
            self._in_backward,
            self._optimizer_core,
            self._config.offload_to_cpu,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; with ``accumulate_on_host`` also drops the gradients of
        the ``no_sync()`` micro-batches summed on the host since the last synchronized step.

        Args:
            set_to_none: as ``nn.Module.zero_grad``'s.
        """
        super().zero_grad(set_to_none)
        if self._config.accumulate_on_host:
            self.reducer.discard_host_gradients()

    def offload_stats(self) -> dict[str, float]:
        """offload_to_cpu's host side, counted since construction: ``iterations`` and
        ``buckets`` stepped on the host, ``step_seconds`` (the worker's busy time),
        ``wait_seconds`` (time the training loop was blocked waiting for it, at forwards and
        state reads), and ``grad_norm``: the last step's total gradient norm before clipping
        (what ``clip_grad_norm_`` returns; -1 without ``max_grad_norm``). Zeros without
        offload_to_cpu."""
        return _stats.offload_stats(self._optimizer_core)

    def sharded_optimizer_state_dict(self) -> dict[str, Any]:
        """shard_optimizer_state: this rank's shard of ``self.optimizer``'s state, for
        ``torch.distributed.checkpoint.save``/``load`` without gathering it (every rank calls
        it): per parameter name, ``step`` and each state tensor as a ShardedTensor whose local
        shard is a live view of this rank's piece, plus the param groups. To restore, pass a
        fresh one to ``dcp.load`` (which loads the pieces in place) and then to
        :meth:`load_sharded_optimizer_state_dict`. Loads at another world size too."""
        from . import _sharded_checkpoint  # (loads torch's ShardedTensor: only when used)

        return _sharded_checkpoint.sharded_state_dict(
            self.process_group, self._params, self._param_names, self._in_backward
        )

    def load_sharded_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """After ``dcp.load(state_dict, ...)`` of a :meth:`sharded_optimizer_state_dict` of
        this wrapper: sets the step counts and the param groups' hyper-parameters.

        Args:
            state_dict: the dictionary ``dcp.load`` filled.
        """
        from . import _sharded_checkpoint

        _sharded_checkpoint.load_sharded_state_dict(
            self._param_names, self._in_backward, state_dict
        )

    def synchronize(self) -> None:
        """Makes the last step's updates visible to the caller: with ``offload_to_cpu`` the
        host waits until the host steps' updates are in the parameters and raises an error the
        host step met; with ``optimizer_in_backward`` on a GPU the current stream is ordered
        after the steps (the host does not wait); otherwise a no-op. ``self.optimizer.step()``
        does the same (so the parameters are current right after it, as after torch's step),
        and forwards, ``state_dict()`` of the wrapped modules and ``self.optimizer``'s state wait
        by themselves; on a GPU the end of backward orders the stream that called it. Call it
        before reading parameters any other way between a backward and the next forward."""
        if self._optimizer_core is not None:
            self._optimizer_core.wait_for_steps(host_too=self._config.offload_to_cpu)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's DDP logging data, with torch's keys and meanings (see docs/ddp.md): the
        constructor's arguments, parameter and bucket sizes, environment variables, the
        runtime statistics of sampled iterations (ns), ``comm_hook``, ``static_graph``,
        ``join_uneven_inputs`` and ``has_error``/``error``."""
        return self.logger._get_ddp_logging_data()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Measures runtime statistics every ``sample_rate``-th iteration after the first 10
        (torch's rule; 100 by default). ValueError if ``sample_rate < 1``."""
        self.logger.set_sample_rate(sample_rate)

    # ----------------------------------------------------------------------------------------
    # pickling: the C++ state is rebuilt, on the default process group (torch's rule)

    def __getstate__(self) -> dict[str, Any]:
        if self._in_backward is not None:
            raise RuntimeError(
                "leanddp.DistributedDataParallel with optimizer_in_backward cannot be pickled; "
                "checkpoint ddp.state_dict() and ddp.optimizer.state_dict() instead."
            )
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "leanddp.DistributedDataParallel can be pickled only when it uses the default "
                "process group (no process_group argument), as with torch's DDP."
            )
        state = copy.copy(self.__dict__)
        for key in ("process_group", "reducer", "_params", "_waits", "_optimizer_core"):
            state.pop(key, None)
        state["_config"] = self._config.without_group()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)  # type: ignore[no-untyped-call]  # unannotated in torch
        self.process_group = dist.distributed_c10d._get_default_group()
        self._config = self._config.with_group(self.process_group)
        self._optimizer_core = None  # (not pickled: pickling refuses optimizer_in_backward)
        self._build_reducer()

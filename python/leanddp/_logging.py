"""torch's DDP logging data (``_get_ddp_logging_data``) for leanddp.DistributedDataParallel.

torch's DDP keeps it in a C++ ``dist.Logger`` bound to its own reducer, which leanddp does not
build; :class:`DDPLogger` keeps the same keys with the same meanings: the constructor's
arguments, the parameters and buckets, the environment variables torch records, the runtime
statistics of sampled iterations, the communication hook, and the last user-facing error.

Sampling follows torch: the first :data:`ALWAYS_SAMPLED` iterations and then every
``sample_rate``-th one (:data:`DEFAULT_SAMPLE_RATE` unless changed with
``_set_ddp_runtime_logging_sample_rate``) are measured by the C++ Reducer (host clock on the CPU,
timing events on a GPU, read here, at the next synchronized forward); the statistics of an
iteration are logged at the start of the next one, as torch does.

Two keys follow torch's C++ Logger in less obvious ways:

* ``can_set_static_graph``: torch logs it once per process (a ``once_flag`` shared by every
  DDP), by the first wrapper with ``find_unused_parameters`` (no static graph) whose set of
  unused parameters changes after its first iteration (0, and ``iteration`` is set to the current
  one), or by the first wrapper destroyed (which uses the flag up unseen). leanddp's wrappers
  share a flag of their own.
* ``has_error``/``error``: besides the errors raised from Python (``"<class>: <message>"``), the
  Reducer's checks of how it is used that fail inside backward (torch's ``REDUCER_CHECK``:
  a gradient missing or received twice, a dense/sparse mismatch) are recorded with their message
  alone, as torch records them, and ``iteration`` is set to the current one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from ._config import DDPConfig
    from ._extension import _C

#: torch's kDDPRuntimeLoggingSampleRate.
DEFAULT_SAMPLE_RATE = 100
#: The first iterations are always measured (torch's rule).
ALWAYS_SAMPLED = 10

#: How torch's logging data spells dtypes (c10's names).
C10_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}

_COMMON_ENV: dict[str, tuple[str, ...]] = {
    "master_port": ("MASTER_PORT",),
    "master_addr": ("MASTER_ADDR",),
    "torch_distributed_debug": ("TORCH_DISTRIBUTED_DEBUG",),
    "cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",),
}
_BACKEND_ENV: dict[str, dict[str, tuple[str, ...]]] = {
    "nccl": {
        "nccl_socket_ifname": ("NCCL_SOCKET_IFNAME",),
        "nccl_blocking_wait": ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"),
        "nccl_async_error_handling": (
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "NCCL_ASYNC_ERROR_HANDLING",
        ),
        "nccl_debug": ("NCCL_DEBUG",),
        "nccl_nthreads": ("NCCL_NTHREADS",),
        "nccl_ib_timeout": ("NCCL_IB_TIMEOUT",),
    },
    "gloo": {
        "gloo_socket_ifname": ("GLOO_SOCKET_IFNAME",),
        "gloo_device_transport": ("GLOO_DEVICE_TRANSPORT",),
    },
}
#: ProcessGroupGloo's default number of threads (what torch logs when it cannot ask).
_GLOO_DEFAULT_THREADS = 2

_RUNTIME_KEYS: Final = (
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
)
_HOST_KEYS = (
    "forward_compute_time_start",
    "backward_compute_time_start",
    "backward_compute_time_end",
    "backward_comm_time_start",
    "backward_comm_time_end",
)


def _env(names: tuple[str, ...]) -> str:
    for name in names:
        if name in os.environ:
            return os.environ[name]
    return "N/A"


def _gloo_threads(group: dist.ProcessGroup) -> int:
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)  # type: ignore[attr-defined]  # gloo's Options; torch types the base class
    except Exception:  # not exposed by this torch: torch's default
        return _GLOO_DEFAULT_THREADS


class DDPLogger:
    """The logging data of one wrapper, with torch's keys (strings and ints in one dict)."""

    _graph_static_logged = False
    """Whether a wrapper of this process has logged ``can_set_static_graph`` (torch's
    process-wide ``once_flag``; see the module's docstring)."""

    def __init__(self) -> None:
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.num_iterations = 0
        """torch's reducer ``num_iterations_``: forwards that prepared a synchronized backward."""
        self.data: dict[str, Any] = {}
        self._stats_recorded = 0
        self._graph_static = True
        """torch's reducer ``ddp_graph_static_``: no change seen in the set of unused
        parameters from one iteration to the next."""
        self._prev_unused: list[int] = []
        # attach(): the Reducer whose data and errors are read
        self._reducer: _C.Reducer | None = None
        self._params: Sequence[Tensor] = ()  # attach(): its parameters, in its order

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # (the unpickled wrapper attaches its new Reducer)
        state["_reducer"], state["_params"] = None, ()
        return state

    def __del__(self) -> None:
        # torch's Logger logs whether the graph stayed static when it is destroyed (after
        # construction), which uses up the process's flag.
        if self.data:
            self._log_if_graph_static(self._graph_static)

    def attach(self, reducer: _C.Reducer, params: Sequence[Tensor]) -> None:
        """Reads ``reducer`` (a ``_C.Reducer`` over ``params``, in its order) from now on: its
        buckets, timings, unused parameters and failed usage checks; called whenever the
        wrapper builds its Reducer."""
        self._reducer = reducer
        self._params = params

    def set_construction_data(self, module: nn.Module, config: DDPConfig) -> None:
        """Records the constructor's arguments (``config``), the wrapped ``module``, the
        parameters, the buckets and the environment (torch's ``set_construction_data_and_log``);
        called at construction, after :meth:`attach`. As in torch, ``comm_hook``,
        ``static_graph`` and ``join_uneven_inputs`` appear once set, and the runtime keys at the
        first sampled iteration."""
        params = self._params
        group = config.process_group
        assert group is not None and self._reducer is not None  # (at construction, attached)
        backend = group.name()
        d = self.data
        d.update(
            module_name=type(module).__name__,
            device_ids=", ".join(str(i) for i in (config.device_ids or [])),
            output_device=config.output_device if config.output_device is not None else -1,
            broadcast_buffers=int(config.forward_sync_buffers),
            has_sync_bn=int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())),
            bucket_cap_bytes=config.caps_bytes[-1],
            find_unused_parameters=int(config.find_unused_parameters),
            gradient_as_bucket_view=int(config.gradient_as_bucket_view),
            backend_name=backend,
            rank=group.rank(),
            world_size=group.size(),
            is_multi_device_module=0,
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            dtypes=", ".join(sorted({C10_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            bucket_sizes=", ".join(str(b) for b in self._reducer.bucket_bytes()),
            iteration=0,
        )
        for key, names in _COMMON_ENV.items():
            d[key] = _env(names)
        for key, names in _BACKEND_ENV.get(backend, {}).items():
            d[key] = _env(names)
        if backend == "gloo":
            d["gloo_num_threads"] = _gloo_threads(group)

    def set_sample_rate(self, sample_rate: int) -> None:
        """torch's ``_set_ddp_runtime_logging_sample_rate``: TypeError unless an int,
        ValueError if below 1, each recorded as an error first (torch's ``_log_and_throw``)."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int):
            message = f"sample_rate must be an int, got {type(sample_rate).__name__}"
            self.set_error_and_log(f"{TypeError}: {message}")
            raise TypeError(message)
        if sample_rate < 1:
            message = "DDP runtime logging sample rate should be equal or greater than 1"
            self.set_error_and_log(f"{ValueError}: {message}")
            raise ValueError(message)
        self.sample_rate = int(sample_rate)

    def _sampled(self, iteration: int) -> bool:
        return iteration > 0 and (iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0)

    def before_forward(self) -> None:
        """At a forward that prepares a synchronized backward, before the module runs: logs
        the last iteration's statistics if it was sampled, counts this iteration and tells the
        Reducer whether to measure it (torch's ``set_runtime_stats_and_log`` and
        ``prepare_for_forward``)."""
        self._record_usage_error()  # (with the iteration it was raised in)
        if self._sampled(self.num_iterations):
            self._log_runtime()
        self.num_iterations += 1
        assert self._reducer is not None  # (attached: the wrapper's forward)
        self._reducer.time_iteration(self._sampled(self.num_iterations))

    def after_search(self) -> None:
        """After a forward's search for unused parameters (find_unused_parameters without a
        static graph): torch's check that the graph could be declared static. The first change
        of the set of unused parameters after the first iteration logs
        ``can_set_static_graph`` = 0 (once per process)."""
        if not self._graph_static:
            return
        assert self._reducer is not None  # (attached: the wrapper's forward)
        unused = self._reducer.unused_parameters()
        if self.num_iterations > 1 and unused != self._prev_unused:
            self._graph_static = False
            self._log_if_graph_static(False)
        self._prev_unused = unused

    def _log_if_graph_static(self, is_static: bool) -> None:
        if DDPLogger._graph_static_logged:
            return
        DDPLogger._graph_static_logged = True
        self.data["can_set_static_graph"] = int(is_static)
        self.data["iteration"] = self.num_iterations  # (torch's: where training got to)

    def _log_runtime(self) -> None:
        d = self.data
        self._stats_recorded += 1
        d["iteration"] = self.num_iterations
        reducer, params = self._reducer, self._params
        assert reducer is not None  # (attached: the wrapper's forward)
        times = reducer.collect_times()
        # torch's: the parameters found unused by the last synchronized forward (its reducer's
        # unused_parameters_), summed afresh at each sampled iteration
        d["unused_parameter_size"] = sum(
            params[i].numel() * params[i].element_size() for i in reducer.unused_parameters()
        )
        rebuilt = int(reducer.has_rebuilt_buckets())
        if d.setdefault("has_rebuilt_buckets", 0) != rebuilt:
            d["has_rebuilt_buckets"] = rebuilt
            d["rebuilt_bucket_sizes"] = ", ".join(str(b) for b in reducer.bucket_bytes())
            d["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(str(i) for i in bucket) for bucket in reducer.bucket_indices()
            )
        if times is None:
            return
        d["num_buckets_reduced"] = len(reducer.bucket_bytes())  # every bucket, each iteration
        if times["grad_ready_order"]:
            d["prev_iteration_grad_ready_order_indices"] = ", ".join(
                str(i) for i in times["grad_ready_order"]
            )
        n = self._stats_recorded
        for key in _RUNTIME_KEYS:
            value = times[key]
            d[key] = value
            d[f"avg_{key}"] = (d.get(f"avg_{key}", 0) * (n - 1) + value) // n
        d.update(zip(_HOST_KEYS, times["host_ns"], strict=True))

    # torch's dist.Logger method names, for code written against torch's DDP (``ddp.logger``)

    def _set_comm_hook_name(self, name: str) -> None:
        self.data["comm_hook"] = name

    def _set_static_graph(self) -> None:
        self.data["static_graph"] = 1

    def _set_uneven_input_join(self) -> None:
        self.data["join_uneven_inputs"] = 1

    def set_error_and_log(self, error: str) -> None:
        """Records a user-facing error, ``"<exception type>: <message>"`` as torch's DDP
        writes it (``has_error`` and ``error``), and the iteration it was raised in."""
        self._record_usage_error()  # (raised before this one)
        self._set_error(error)

    def _set_error(self, error: str) -> None:
        self.data["has_error"] = 1
        self.data["error"] = error
        self.data["iteration"] = self.num_iterations

    def _record_usage_error(self) -> None:
        """Records the Reducer's last failed usage check, if one failed since the last look
        (its message alone, as torch's logger records its reducer's checks). Called before
        anything else is recorded and before ``num_iterations`` changes, so the error and its
        iteration are what torch's logger would hold."""
        error = self._reducer.take_usage_error() if self._reducer is not None else None
        if error is not None:
            self._set_error(error)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """A copy of the logging data (torch's strings and ints in one dict)."""
        self._record_usage_error()
        return dict(self.data)

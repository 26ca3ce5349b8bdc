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
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

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

_COMMON_ENV = {
    "master_port": ("MASTER_PORT",),
    "master_addr": ("MASTER_ADDR",),
    "torch_distributed_debug": ("TORCH_DISTRIBUTED_DEBUG",),
    "cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",),
}
_BACKEND_ENV = {
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

_RUNTIME_KEYS = (
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
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except Exception:  # not exposed by this torch: torch's default
        return _GLOO_DEFAULT_THREADS


class DDPLogger:
    """The logging data of one wrapper, with torch's keys (strings and ints in one dict)."""

    def __init__(self) -> None:
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.num_iterations = 0
        """torch's reducer ``num_iterations_``: forwards that prepared a synchronized backward."""
        self.data: dict[str, Any] = {}
        self._stats_recorded = 0

    def set_construction_data(self, ddp: Any) -> None:
        """Records the constructor's arguments, the parameters, the buckets and the
        environment (torch's ``set_construction_data_and_log``); called at construction. As in
        torch, ``comm_hook``, ``static_graph`` and ``join_uneven_inputs`` appear once set, and
        the runtime keys at the first sampled iteration."""
        params = ddp._params
        group = ddp.process_group
        backend = group.name()
        d = self.data
        d.update(
            module_name=type(ddp.module).__name__,
            device_ids=", ".join(str(i) for i in (ddp.device_ids or [])),
            output_device=ddp.output_device if ddp.output_device is not None else -1,
            broadcast_buffers=int(ddp.forward_sync_buffers),
            has_sync_bn=int(
                any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())
            ),
            bucket_cap_bytes=ddp.bucket_bytes_cap,
            find_unused_parameters=int(ddp.find_unused_parameters),
            gradient_as_bucket_view=int(ddp.gradient_as_bucket_view),
            backend_name=backend,
            rank=group.rank(),
            world_size=group.size(),
            is_multi_device_module=0,
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            dtypes=", ".join(sorted({C10_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            bucket_sizes=", ".join(str(b) for b in ddp.reducer.bucket_bytes()),
            iteration=0,
        )
        for key, names in _COMMON_ENV.items():
            d[key] = _env(names)
        for key, names in _BACKEND_ENV.get(backend, {}).items():
            d[key] = _env(names)
        if backend == "gloo":
            d["gloo_num_threads"] = _gloo_threads(group)

    def set_sample_rate(self, sample_rate: int) -> None:
        """torch's ``_set_ddp_runtime_logging_sample_rate`` (the caller validated it)."""
        self.sample_rate = int(sample_rate)

    def _sampled(self, iteration: int) -> bool:
        return iteration > 0 and (iteration <= ALWAYS_SAMPLED or iteration % self.sample_rate == 0)

    def before_forward(self, ddp: Any) -> None:
        """At a forward that prepares a synchronized backward, before the module runs: logs
        the last iteration's statistics if it was sampled, counts this iteration and tells the
        Reducer whether to measure it (torch's ``set_runtime_stats_and_log`` and
        ``prepare_for_forward``)."""
        if self._sampled(self.num_iterations):
            self._log_runtime(ddp)
        self.num_iterations += 1
        ddp.reducer.time_iteration(self._sampled(self.num_iterations))

    def _log_runtime(self, ddp: Any) -> None:
        d = self.data
        self._stats_recorded += 1
        d["iteration"] = self.num_iterations
        times = ddp.reducer.collect_times()
        unused = times["unused"] if times is not None else []
        params = ddp._params
        d["unused_parameter_size"] = sum(
            params[i].numel() * params[i].element_size() for i in unused
        )
        rebuilt = int(ddp.reducer.has_rebuilt_buckets())
        if d.setdefault("has_rebuilt_buckets", 0) != rebuilt:
            d["has_rebuilt_buckets"] = rebuilt
            d["rebuilt_bucket_sizes"] = ", ".join(str(b) for b in ddp.reducer.bucket_bytes())
            d["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(str(i) for i in bucket) for bucket in ddp.reducer.bucket_indices()
            )
        if times is None:
            return
        d["num_buckets_reduced"] = len(ddp.reducer.bucket_bytes())  # every bucket, each iteration
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
        writes it (``has_error`` and ``error``)."""
        self.data["has_error"] = 1
        self.data["error"] = error

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """A copy of the logging data (torch's strings and ints in one dict)."""
        return dict(self.data)

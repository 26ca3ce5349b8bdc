"""Type stub of leanddp._C, the C++/CUDA extension: what csrc/bindings*.cpp bind.

Kept by hand, next to the bindings: a change to a binding (its name, arguments, defaults or
what it returns) changes this file in the same commit. Sections follow the binding files
(bindings_reducer.cpp, bindings_optimizer.cpp, bindings_modes.cpp, bindings.cpp,
bindings_testing.cpp). C++
vectors are lists where the extension returns them and any sequence where it takes them;
int64_t/size_t are int, double is float, c10::Device is torch.device, at::ScalarType is
torch.dtype; a process group is torch's ProcessGroup. The dictionaries the extension builds are
TypedDicts here, and the callables it takes aliases: they exist only for the type checker
(underscored, never imported at run time).

Checked against a build by ``python -m mypy.stubtest leanddp._C``: names, arguments and defaults
agree; it reports only pybind11's metaclass and the classes without a constructor.
"""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol, TypedDict, overload

import torch
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.distributed import ProcessGroup

# ------------------------------------------------------------------------------------------------
# The Reducer's accounts (csrc/reducer.h MemoryStats): read-only, made by Reducer.memory_stats()

class MemoryStats:
    @property
    def bucket_bytes(self) -> int: ...
    @property
    def grad_bytes(self) -> int: ...
    @property
    def grads_as_views(self) -> int: ...
    @property
    def grads_outside(self) -> int: ...
    @property
    def num_buckets(self) -> int: ...
    @property
    def peak_bucket_bytes(self) -> int: ...
    @property
    def max_buckets_in_flight(self) -> int: ...
    @property
    def recycled_bucket_bytes(self) -> int: ...
    @property
    def host_accumulation_bytes(self) -> int: ...
    @property
    def host_pinned_bytes(self) -> int: ...

# ------------------------------------------------------------------------------------------------
# optimizer_in_backward's optimizer (csrc/in_backward_optimizer.h, csrc/fused_optimizer.h; the
# Python side: leanddp.optim)

class OptimKind:  # a pybind11 enum (not an enum.Enum)
    __members__: ClassVar[dict[str, OptimKind]]
    sgd: ClassVar[OptimKind]
    adam: ClassVar[OptimKind]
    adam8bit: ClassVar[OptimKind]  # torchao's AdamW8bit / Adam8bit
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __index__(self) -> int: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class OptimHyper:  # one parameter group's hyper-parameters for the fused kernels
    def __init__(
        self,
        *,
        lr: float,
        lr_tensor: Tensor | None = None,  # a tensor lr the kernels read (lr is then unused)
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        decoupled: bool = False,
    ) -> None: ...
    @property
    def lr(self) -> float: ...
    @property
    def lr_tensor(self) -> Tensor | None: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def dampening(self) -> float: ...
    @property
    def nesterov(self) -> bool: ...
    @property
    def maximize(self) -> bool: ...
    @property
    def decoupled(self) -> bool: ...

class InBackwardOptions:
    kind: OptimKind | None  # None: every bucket goes to the fallback
    group_of: list[int]  # per parameter: its group
    groups: list[OptimHyper]
    step_device: str  # where the step counts live ("cpu" by default)
    offload_to_cpu: bool
    offload_threads: int
    sharded: bool
    max_grad_norm: float | None  # host steps' clipping (offload_to_cpu)
    block_size: int  # adam8bit: torchao's block size
    qmaps: tuple[Tensor, Tensor]  # adam8bit: torchao's signed and unsigned maps
    def __init__(self) -> None: ...

class OffloadStats:
    @property
    def iterations(self) -> int: ...
    @property
    def buckets(self) -> int: ...
    @property
    def step_seconds(self) -> float: ...
    @property
    def wait_seconds(self) -> float: ...
    @property
    def grad_norm(self) -> float: ...  # -1.0 without clipping
    @property
    def master_bytes(self) -> int: ...
    @property
    def host_buffer_bytes(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...

class OptimizerMemory:
    @property
    def state_bytes(self) -> int: ...
    @property
    def host_master_bytes(self) -> int: ...
    @property
    def host_buffer_bytes(self) -> int: ...
    @property
    def host_pinned_bytes(self) -> int: ...

# The step of the buckets the fused kernels do not cover: (bucket index, parameter indices, their
# gradients), with the GIL, on the autograd thread (csrc/bucket_stepper.h).
_FallbackStep = Callable[[int, list[int], list[Tensor]], object]

class InBackwardOptimizer:
    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        process_group: ProcessGroup,
        options: InBackwardOptions,
        fallback: _FallbackStep | None,
    ) -> None: ...
    # the forward's waits
    def wait_for_steps(self, host_too: bool = False) -> None: ...
    def pending_steps(self, follow_copies: bool = False) -> list[int]: ...
    def follow_steps(self) -> None: ...
    def wait_for_bucket(self, index: int) -> None: ...
    # before each forward
    def set_groups(self, groups: Sequence[OptimHyper]) -> None: ...
    def set_grad_scaler(self, scale: Tensor | None, found_inf: Tensor | None) -> None: ...
    # the fused state (lists of (torch's key, tensor) per parameter)
    def state(self, param: int) -> list[tuple[str, Tensor]]: ...
    def load_state(self, param: int, step: int, values: Sequence[Tensor]) -> None: ...
    def load_master_weight(self, param: int, value: Tensor) -> None: ...
    def adopt_master_weights(self) -> None: ...
    def generation(self) -> int: ...
    def gathered_state(self) -> list[list[tuple[str, Tensor]]]: ...
    # per parameter, its pieces on every rank as [rank, first element, elements]
    def shard_placement(self) -> list[list[list[int]]]: ...
    # this rank's pieces as (parameter, torch's key, a live 1-D view)
    def local_state(self) -> list[tuple[int, str, Tensor]]: ...
    def steps(self) -> list[int]: ...
    def set_steps(self, steps: Sequence[int]) -> None: ...
    # statistics
    def stats(self) -> OffloadStats: ...
    def memory_stats(self) -> OptimizerMemory: ...
    def events_created(self) -> int: ...
    def attached(self) -> bool: ...
    # test hooks
    def _delay_host_steps(self, seconds: float) -> None: ...
    def _delay_copies_back(self, seconds: float) -> None: ...
    # the next `count` host jobs of `kind` (of bucket `bucket` only, if >= 0) raise
    def _inject_host_faults(self, kind: _HostFault, count: int, bucket: int = -1) -> None: ...
    # (stream id, device index, device type), or None without one
    def _copy_back_stream(self) -> tuple[int, int, int] | None: ...

class StateSpec:  # read-only, made by state_spec() only
    @property
    def stepped(self) -> bool: ...
    @property
    def unfit(self) -> str: ...  # "dtype", "layout", or ""
    @property
    def needs(self) -> str: ...
    @property
    def counted(self) -> bool: ...
    @property
    def buffers(self) -> list[str]: ...
    @property
    def master(self) -> bool: ...
    @property
    def quantized(self) -> bool: ...  # adam8bit: 8-bit codes and scales (else plain moments)
    @property
    def block(self) -> int: ...  # adam8bit: the block size
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def keys(self) -> list[str]: ...

def state_spec(
    kind: OptimKind, param: Tensor, on_host: bool, momentum: bool, block: int = 0
) -> StateSpec: ...

# ------------------------------------------------------------------------------------------------
# The Reducer's settings (csrc/modes.h NanCheck, csrc/reducer.h ReducerOptions)

class NanCheck:  # a pybind11 enum (not an enum.Enum)
    __members__: ClassVar[dict[str, NanCheck]]
    off: ClassVar[NanCheck]
    on: ClassVar[NanCheck]
    strict: ClassVar[NanCheck]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __index__(self) -> int: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class ReducerOptions:
    caps_bytes: list[int]
    initial_caps_bytes: list[int]
    gradient_as_bucket_view: bool
    find_unused_parameters: bool
    static_graph: bool
    optimizer_in_backward: bool
    sparse_names: list[str]
    buckets_in_flight: int
    nan_check: NanCheck
    shard_optimizer_state: bool
    shard_block: int
    shard_block_names: list[str]
    accumulate_on_host: bool
    max_grad_norm: float | None
    def __init__(self) -> None: ...

# ------------------------------------------------------------------------------------------------
# The Reducer (csrc/reducer.h)

class _HookFuture(Protocol):
    """What a communication hook's launcher returns (a torch.futures.Future): its value is the
    reduced tensor, or a list or tuple holding it first."""

    def wait(self) -> Any: ...
    def done(self) -> bool: ...

# A communication hook's launcher, called per bucket: (index, bucket count, the bucket's buffer,
# its parameters' indices, their offsets and lengths in the buffer, in elements).
_Launcher = Callable[[int, int, Tensor, list[int], list[int], list[int]], _HookFuture]

class _IterationTimes(TypedDict):  # collect_times() (csrc/iteration_timer.h), in ns
    host_ns: list[int]
    forward_compute_time: int
    backward_compute_time: int
    backward_comm_time: int
    backward_compute_comm_overlap_time: int
    grad_ready_order: list[int]

class Reducer:
    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        process_group: ProcessGroup,
        options: ReducerOptions,
    ) -> None: ...
    @property
    def options(self) -> ReducerOptions: ...

    # the training step
    def prepare_for_forward(self) -> list[str]: ...
    @overload
    def prepare_for_backward(self, outputs: Sequence[Tensor]) -> None: ...
    @overload
    def prepare_for_backward(self, output: Tensor) -> None: ...
    def rebuild_buckets(self) -> bool: ...
    def set_static_graph(self) -> None: ...
    def _rebuild_buckets(self) -> bool: ...  # torch's reducer's names
    def _set_static_graph(self) -> None: ...
    def register_comm_hook(self, launch: _Launcher) -> None: ...

    # optimizer_in_backward: every reduced bucket goes to `optimizer`
    def set_optimizer(self, optimizer: InBackwardOptimizer) -> None: ...
    # accumulate_on_host: the no_sync() micro-batches' host sums dropped
    def discard_host_gradients(self) -> None: ...

    # lifetime
    def close(self) -> None: ...
    def closed(self) -> bool: ...

    # statistics and logging data
    def memory_stats(self) -> MemoryStats: ...
    def events_created(self) -> int: ...
    def bucket_indices(self) -> list[list[int]]: ...
    def bucket_bytes(self) -> list[int]: ...
    def has_rebuilt_buckets(self) -> bool: ...
    def num_iterations(self) -> int: ...
    def time_iteration(self, sampled: bool) -> None: ...
    def unused_parameters(self) -> list[int]: ...
    def take_usage_error(self) -> str | None: ...
    def collect_times(self) -> _IterationTimes | None: ...

    # test hooks
    # accumulate_on_host: the worker sleeps seconds[b] before each addition of bucket b
    def _delay_additions(self, seconds: Sequence[float]) -> None: ...
    # (bucket, the bucket its storage came from, whether that one's step was not known finished)
    def _recycler_reuses(self) -> list[tuple[int, int, bool]]: ...

BUCKETS_IN_FLIGHT: int  # ReducerOptions.buckets_in_flight's default
MIN_QUANTIZED_8BIT: int  # torchao's fewest elements of a tensor with 8-bit state
MAX_QUANT_BLOCK: int  # the largest block the 8-bit kernels quantize

# ------------------------------------------------------------------------------------------------
# Which modes combine (csrc/modes.h)

class ModeError:
    @property
    def argument(self) -> str: ...
    @property
    def message(self) -> str: ...

class Modes:
    optimizer_in_backward: bool
    offload_to_cpu: bool
    shard_optimizer_state: bool
    accumulate_on_host: bool
    max_grad_norm: bool
    offload_threads: bool
    grad_scaler: bool
    grad_scaler_enabled: bool
    comm_hook: bool
    check_for_nan_in_grad: NanCheck
    sparse_parameter: str
    def __init__(
        self,
        *,
        optimizer_in_backward: bool = False,
        offload_to_cpu: bool = False,
        shard_optimizer_state: bool = False,
        accumulate_on_host: bool = False,
        max_grad_norm: bool = False,
        offload_threads: bool = False,
        grad_scaler: bool = False,
        grad_scaler_enabled: bool = True,
        comm_hook: bool = False,
        check_for_nan_in_grad: NanCheck = ...,
        sparse_parameter: str = "",
    ) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __copy__(self) -> Modes: ...
    def __deepcopy__(self, memo: dict[Any, Any]) -> Modes: ...

def check_modes(modes: Modes) -> ModeError | None: ...

# ------------------------------------------------------------------------------------------------
# Module functions

class _BuildInfo(TypedDict):
    torch_version: str  # the torch it was compiled against
    version: str  # leanddp's
    cuda: bool  # whether it has its CUDA kernels
    cpu_isa: str  # the instruction set its CPU kernels use on this machine

def build_info() -> _BuildInfo: ...
def make_grad_bucket(
    index: int,
    bucket_count: int,
    buffer: Tensor,
    offsets: Sequence[int],
    lengths: Sequence[int],
    params: Sequence[Tensor],
) -> GradBucket: ...

# lists of parameter indices, per device and dtype
def assign_buckets(
    params: Sequence[Tensor], order: Sequence[int], caps_bytes: Sequence[int]
) -> list[list[int]]: ...

# ------------------------------------------------------------------------------------------------
# shard_optimizer_state's cut of a bucket (csrc/shard.h)

class _ShardLayout(TypedDict):
    padded: int
    shard_numel: int
    begin: int
    pieces: list[tuple[int, int, int, int]]  # (slot, slot_offset, shard_offset, numel)

def shard_layout(
    offsets: Sequence[int],
    numels: Sequence[int],
    bucket_numel: int,
    align: int,
    world: int,
    rank: int,
) -> _ShardLayout: ...

# ------------------------------------------------------------------------------------------------
# Test seams (bindings_testing.cpp: the submodule leanddp._C._testing, which leanddp itself never
# calls; typed here as a namespace)

# ------------------------------------------------------------------------------------------------
# The step window (csrc/step_window.h), for the tests that drive it directly

_Phase = Literal["after_hook", "before_launch", "end"]
_Action = Literal["step", "step_waiting", "finish"]

class _StepWindow:  # _testing.StepWindow
    def __init__(self, capacity: int, device_ordered: bool) -> None: ...
    def reset(self, carried: int = 0) -> None: ...
    # (action, bucket; None for a carried step), or None when nothing is to be done
    def next(
        self, phase: _Phase, ready: Callable[[int], bool]
    ) -> tuple[_Action, int | None] | None: ...
    def launched_one(self) -> None: ...
    def stepped_one(self) -> None: ...
    def finished_one(self) -> None: ...
    @property
    def launched(self) -> int: ...
    @property
    def stepped(self) -> int: ...
    @property
    def finished(self) -> int: ...
    @property
    def carried(self) -> int: ...
    @property
    def in_flight(self) -> int: ...

class _HostOrderingCounts(TypedDict):
    streams: int
    records: int
    blocks: int
    synchronizes: int
    records_on_stream: int

class _HostFault:  # _testing.HostFault, a pybind11 enum (not an enum.Enum)
    __members__: ClassVar[dict[str, _HostFault]]
    addition: ClassVar[_HostFault]  # an addition of a no_sync() micro-batch (accumulate_on_host)
    step: ClassVar[_HostFault]  # a host step
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __index__(self) -> int: ...
    def __int__(self) -> int: ...

class _testing:
    StepWindow: ClassVar[type[_StepWindow]]
    HostFault: ClassVar[type[_HostFault]]
    @staticmethod
    def reduce_to_shard(
        process_group: ProcessGroup,
        flat: Tensor,
        offsets: Sequence[int],
        numels: Sequence[int],
        bucket_numel: int,
        align: int,
    ) -> None: ...
    @staticmethod
    def set_host_ordering(on: bool) -> None: ...
    @staticmethod
    def quantize8(x: Tensor, qmap: Tensor, table: bool, bounded: bool = ...) -> Tensor: ...
    @staticmethod
    def dequantize8(codes: Tensor, qmap: Tensor, scale: float, table: bool = ...) -> Tensor: ...
    @staticmethod
    def host_ordering_counts() -> _HostOrderingCounts: ...
    @staticmethod
    def reduces_scattered(process_group: ProcessGroup, device: str) -> bool: ...
    @staticmethod
    def pack_and_gather_shards(
        process_group: ProcessGroup,
        flat: Tensor,
        offsets: Sequence[int],
        numels: Sequence[int],
        bucket_numel: int,
        align: int,
        sources: Sequence[Tensor],
    ) -> None: ...
    @staticmethod
    def offload_released_on_worker(after_error: bool = False) -> bool: ...
    @staticmethod
    def parallel_threads() -> int: ...

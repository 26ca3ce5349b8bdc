"""The memory model: what one rank holds for each configuration, by category, in bytes.

One implementation serves ``python -m leanddp.plan`` (will it fit?), the bench's targets
(``python -m leanddp.bench``) and the tables of docs/memory.md (a test checks them against
this). Activations, the CUDA context and the allocator's caching are outside the model: they are
the model's and the batch's, the same under every configuration.

Categories, per rank (the bench measures the same ones):

- ``parameters``: the trainable parameters.
- ``gradients``: gradients outside the communication buckets. torch's DDP (default
  ``gradient_as_bucket_view=False``) keeps ``param.grad`` apart from its buckets; leanddp's
  gradients are views into the buckets, and only the gradients autograd allocates after
  ``zero_grad(set_to_none=True)`` live outside them, until their bucket is complete: up to one
  bucket (``TRANSIENT_BUCKETS``).
- ``buckets``: the flat communication buckets. All of them, unless buckets are released after
  their step inside backward (``optimizer_in_backward`` without accumulation): then the buckets
  in flight, at most ``BUCKETS_IN_FLIGHT`` of the largest (sharded on the CPU too, where a
  stepped bucket is kept until its all-gather finishes at the next step: the step window holds
  one launched bucket fewer there).
- ``optimizer_state``: optimizer state on the device (the moments, in the parameters' dtype, and
  torch's step counters); 1/N of it with ``shard_optimizer_state``. torchao's 8-bit AdamW
  (``adamw8bit``) keeps one byte per moment element plus a float32 scale per block of 256
  (``LOWBIT_BYTES`` per element for both moments), except for the tensors it keeps plain
  (``Shape.plain8``: fewer than 4096 elements, or not a multiple of the block), whose moments
  are in the parameters' dtype (float32 on the host). Sharded, a rank keeps 1/N of the 8-bit
  moments and room for all the plain ones (every rank's buffers are as long as the longest).
- ``host_state``, ``host_masters``, ``host_staging``: with ``offload_to_cpu``, the float32
  moments, the float32 master weights and the staging buffers in host memory (for float32
  parameters the copy-back staging buffer is the master itself).
- ``host_accumulation``: with ``offload_to_cpu`` and accumulation (``accumulate_on_host``, its
  default), the sums of the ``no_sync()`` micro-batches' gradients and the buffer each later
  micro-batch's copy lands in, in the parameters' dtype: one (accumulation 2) or two of every
  bucket, unsharded (a bucket is reduced, and sharded, only at the synchronized micro-batch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ._extension import _C

#: The in-backward step window: buckets launched, reducing or being stepped at once (the
#: Reducer's StepWindow owns it).
BUCKETS_IN_FLIGHT: int = _C.BUCKETS_IN_FLIGHT
#: Gradients outside the buckets (after ``zero_grad(set_to_none=True)``): up to one bucket.
TRANSIENT_BUCKETS = 1
#: Each sharded bucket is padded to N equal shards of a multiple of this many bytes.
SHARD_ALIGN_BYTES = 16
#: Bytes of one optimizer state element on the host (float32) and of a float32 master weight.
HOST_STATE_BYTES = 4
#: Moments per parameter element of each optimizer kind leanddp's kernels step.
MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-no-momentum": 0}
#: torch's Adam/AdamW keep a float32 step counter per parameter tensor.
STEP_COUNTER_BYTES = {"adamw": 4, "adam": 4, "sgd": 0, "sgd-no-momentum": 0}
#: torchao's 8-bit AdamW (optimizer_in_backward with torchao.optim.AdamW8bit): its moments
#: are 8-bit codes with a float32 scale per block of QUANT_BLOCK elements, in tensors of at
#: least QUANT_MIN elements and a multiple of the block.
MOMENTS["adamw8bit"] = 2
STEP_COUNTER_BYTES["adamw8bit"] = 4  # (float32 tensors on the CPU, as torchao keeps them)
LOWBIT = ("adamw8bit",)
QUANT_BLOCK = 256
QUANT_MIN: int = _C.MIN_QUANTIZED_8BIT  # (the kernels' rule, state_spec's)
#: Bytes per element of an 8-bit tensor's two moments: a code each, and their blocks' scales
#: (torchao's two 256-entry maps, 2 KiB, are left out).
LOWBIT_BYTES = 2 * (1 + 4 / QUANT_BLOCK)

DEVICE_CATEGORIES = ("parameters", "gradients", "buckets", "optimizer_state")
HOST_CATEGORIES = ("host_state", "host_masters", "host_staging", "host_accumulation")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One configuration of data-parallel training."""

    name: str
    wrapper: str
    """``"torch"`` (torch's DDP, its defaults) or ``"leanddp"`` (gradient views)."""
    in_backward: bool = False
    offload: bool = False
    shard: bool = False
    on_host: bool = True
    """offload_to_cpu: ``accumulate_on_host`` (no_sync() micro-batches summed on the host)."""

    @property
    def keeps_first_layout(self) -> bool:
        """Whether its buckets stay as first built (parameters in registration order) instead
        of being rebuilt once in the order gradients arrive: offload_to_cpu with
        shard_optimizer_state (the host's shard-sized state is laid out once)."""
        return self.offload and self.shard


#: Every configuration, in the order the planner and the bench report them (the bench's names).
MODES = (
    Mode("torch DDP", "torch"),
    Mode("leanddp", "leanddp"),
    Mode("leanddp + optimizer_in_backward", "leanddp", in_backward=True),
    Mode("leanddp + offload_to_cpu", "leanddp", in_backward=True, offload=True),
    Mode("leanddp in-backward sharded", "leanddp", in_backward=True, shard=True),
    Mode("leanddp offload sharded", "leanddp", in_backward=True, offload=True, shard=True),
    Mode(
        "leanddp + offload_to_cpu, accumulating on the device",
        "leanddp",
        in_backward=True,
        offload=True,
        on_host=False,
    ),
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the model contributes: its trainable parameters and how they are bucketed."""

    numel: int
    """Trainable parameter elements."""
    element_size: int
    """Bytes of one element (4: float32; 2: bfloat16/float16)."""
    tensors: int
    """Trainable parameter tensors (torch's Adam keeps a step counter per tensor)."""
    buckets: tuple[tuple[int, int], ...] = ()
    """The communication buckets, as (bytes, how many buckets of that size). None given: the
    per-parameter view of a model whose buckets are negligible beside it (all of them hold its
    gradients; none is in flight; no padding)."""
    plain8: int = 0
    """Elements of the tensors torchao's 8-bit optimizers keep plain (fewer than QUANT_MIN
    elements, or not a multiple of QUANT_BLOCK); the others' moments are 8-bit."""

    @classmethod
    def of(
        cls,
        numel: int,
        element_size: int,
        tensors: int,
        buckets: Sequence[int],
        plain8: int = 0,
    ) -> Shape:
        """A shape whose buckets have the sizes ``buckets`` (bytes, one per bucket)."""
        counts: dict[int, int] = {}
        for b in buckets:
            counts[b] = counts.get(b, 0) + 1
        sizes = tuple(sorted(counts.items(), reverse=True))
        return cls(numel, element_size, tensors, sizes, plain8)

    def bucket_sizes(self) -> list[int]:
        """Every bucket's bytes, largest first."""
        return [b for b, n in self.buckets for _ in range(n)]

    @property
    def bucket_count(self) -> int:
        return sum(n for _, n in self.buckets)

    @property
    def largest_bucket(self) -> int:
        return max((b for b, _ in self.buckets), default=0)

    def padded(self, world: int, block: int = 1) -> tuple[tuple[int, int], ...]:
        """Each bucket padded to ``world`` equal shards of whole 16-byte units, and of whole
        blocks of ``block`` elements (8-bit state: the cuts fall on block boundaries)."""
        align = SHARD_ALIGN_BYTES // self.element_size if self.element_size else 1
        unit = math.lcm(max(align, 1), block) * self.element_size * world
        return tuple((math.ceil(b / unit) * unit, n) for b, n in self.buckets)

    @classmethod
    def filled(cls, numel: int, element_size: int, tensors: int, cap: int) -> Shape:
        """``numel`` elements in full buckets of ``cap`` bytes and one with the rest."""
        total = numel * element_size
        full, rest = divmod(total, cap) if cap else (0, total)
        buckets = (((cap, full),) if full else ()) + (((rest, 1),) if rest else ())
        return cls(numel, element_size, tensors, buckets)

    def scaled(self, numel: int) -> Shape:
        """The same shape with ``numel`` elements: as many tensors, buckets of its largest size,
        the same share of plain 8-bit elements."""
        shape = Shape.filled(numel, self.element_size, self.tensors, self.largest_bucket)
        plain8 = self.plain8 * numel // self.numel if self.numel else 0
        return dataclasses.replace(shape, plain8=plain8)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds, by category; ``transient`` of the device bytes are the bucket-sized
    allowance (buckets in flight and gradients outside them), which does not grow with the model
    once its buckets are full."""

    mode: Mode
    bytes: dict[str, float]  # (whole numbers; a float where a shard's share is divided)
    transient: int

    @property
    def device(self) -> float:
        return sum(self.bytes[c] for c in DEVICE_CATEGORIES)

    @property
    def host(self) -> float:
        return sum(self.bytes[c] for c in HOST_CATEGORIES)


#: The bench's 8-bit configurations (``python -m leanddp.bench --lowbit``, torchao's AdamW8bit),
#: each with the configuration of MODES it runs as; the first is their anchor (torch's DDP).
LOWBIT_CONFIGS = {
    "torch DDP + AdamW8bit": "torch DDP",
    "leanddp in-backward 8-bit": "leanddp + optimizer_in_backward",
    "leanddp offload 8-bit": "leanddp + offload_to_cpu",
    "leanddp in-backward sharded 8-bit": "leanddp in-backward sharded",
    "leanddp offload sharded 8-bit": "leanddp offload sharded",
}


def mode(name: str) -> Mode:
    """The configuration of that name (a name of MODES)."""
    for m in MODES:
        if m.name == name:
            return m
    raise ValueError(f"unknown configuration {name!r}; choose from {[m.name for m in MODES]}")


def mode_and_optimizer(config: str) -> tuple[Mode, str]:
    """A bench configuration's mode and optimizer (a key of MOMENTS): an 8-bit one's
    (LOWBIT_CONFIGS) with ``adamw8bit``, any other with ``adamw``."""
    if config in LOWBIT_CONFIGS:
        return mode(LOWBIT_CONFIGS[config]), "adamw8bit"
    return mode(config), "adamw"


def estimate(
    mode: Mode,
    shape: Shape,
    *,
    optimizer: str = "adamw",
    world_size: int = 1,
    accumulation: int = 1,
    clip: bool = False,
) -> Estimate:
    """What one rank holds for ``mode`` training ``shape`` with ``optimizer`` (a key of MOMENTS)
    at ``world_size`` ranks, ``accumulation`` micro-batches per step, with or without gradient
    clipping (``max_grad_norm``), on a GPU or the CPU (the same bytes)."""
    if optimizer not in MOMENTS:
        raise ValueError(f"optimizer must be one of {sorted(MOMENTS)}, got {optimizer!r}")
    if world_size < 1 or accumulation < 1:
        raise ValueError(
            f"world_size and accumulation must be at least 1, got {world_size} and {accumulation}"
        )
    p = shape.element_size
    moments = MOMENTS[optimizer]
    lowbit = optimizer in LOWBIT
    buckets = (
        shape.padded(world_size, QUANT_BLOCK if lowbit else 1) if mode.shard else shape.buckets
    )
    largest = max((b for b, _ in buckets), default=0)
    held = sum(b * n for b, n in buckets) if buckets else shape.numel * p  # every bucket
    counters = STEP_COUNTER_BYTES[optimizer] * shape.tensors
    out: dict[str, float] = dict.fromkeys(DEVICE_CATEGORIES + HOST_CATEGORIES, 0)
    out["parameters"] = shape.numel * p
    transient = 0
    if mode.wrapper == "torch":
        out["gradients"] = shape.numel * p
    else:
        out["gradients"] = transient = TRANSIENT_BUCKETS * largest
    # buckets released inside backward, unless accumulation on the device (or clipping before
    # the sharded device step, which needs the global norm) keeps them all until the end of
    # backward; offload_to_cpu accumulates on the host (accumulate_on_host), where a summed
    # bucket is allocated at its launch as any other
    on_host = mode.offload and mode.on_host and accumulation > 1
    releases = (
        mode.in_backward
        and (accumulation == 1 or on_host)
        and not (clip and mode.shard and not mode.offload)
    )
    if releases:
        released = min(held, BUCKETS_IN_FLIGHT * largest)
        out["buckets"] = released
        transient += released
    else:
        out["buckets"] = held
    # the elements whose state this rank keeps: all, or its shard of every padded bucket
    stepped = (
        (held // (p * world_size) if buckets else shape.numel / world_size)
        if mode.shard
        else shape.numel
    )
    if lowbit:  # the 8-bit moments, the plain ones in their dtype
        quantized: float = shape.numel - shape.plain8
        # (sharded: the quantized tensors' share; the plain ones, which come last in their
        # buckets, are counted whole, as every rank keeps room for the most any rank holds)
        quantized = quantized / world_size if mode.shard else quantized
        plain = shape.plain8 * moments * (HOST_STATE_BYTES if mode.offload else p)
        state = quantized * LOWBIT_BYTES + plain
    else:
        state = moments * (HOST_STATE_BYTES if mode.offload else p) * stepped
    if mode.offload:
        out["host_state"] = state
        out["host_masters"] = HOST_STATE_BYTES * stepped
        # the gradients' staging buffer; bfloat16/float16 add the rounded weights' (float32
        # weights are copied back from the masters themselves)
        out["host_staging"] = (1 if p == HOST_STATE_BYTES else 2) * p * stepped
        if on_host:  # every bucket's sum, and from the second no_sync() micro-batch on the
            # buffer its copy lands in (not padded: a bucket is cut into shards when reduced)
            out["host_accumulation"] = (1 if accumulation == 2 else 2) * shape.numel * p
    else:
        out["optimizer_state"] = state + (0 if mode.in_backward else counters)
    return Estimate(mode, out, transient)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """offload_to_cpu's bytes over PCIe per rank, each way."""

    no_sync_to_host: int
    """Per ``no_sync()`` micro-batch: its gradients, every bucket once (accumulate_on_host)."""
    step_to_host: int
    """Per synchronized micro-batch: the reduced gradients (the rank's shard, sharded)."""
    step_to_device: int
    """Per synchronized micro-batch: the updated weights (the rank's shard, sharded: the rest
    comes through the all-gather), and with accumulation the host sums, every bucket once."""


def pcie_bytes(mode: Mode, shape: Shape, world_size: int = 1, accumulation: int = 1) -> Traffic:
    """What ``mode`` (an offload_to_cpu one; zeros otherwise) copies between the device and the
    host for ``shape`` at ``world_size`` ranks and ``accumulation`` micro-batches per step."""
    if not mode.offload:
        return Traffic(0, 0, 0)
    p = shape.element_size
    whole = shape.numel * p
    shard = (
        sum(b * n for b, n in shape.padded(world_size)) // world_size
        if mode.shard and shape.buckets
        else (whole // world_size if mode.shard else whole)
    )
    on_host = mode.on_host and accumulation > 1
    return Traffic(
        no_sync_to_host=whole if on_host else 0,
        step_to_host=shard,
        step_to_device=shard + (whole if on_host else 0),
    )


def per_parameter(
    mode: Mode, element_size: int = 4, optimizer: str = "adamw", world_size: int = 1
) -> tuple[float, float]:
    """Bytes per parameter (device, host) of ``mode`` for a model whose buckets are negligible
    beside it: the numbers of docs/memory.md's table (fp32 AdamW: torch's DDP 20, leanddp 16,
    + optimizer_in_backward 12, + offload_to_cpu 4 and 16 on the host, sharded 4 + 8/N)."""
    e = estimate(mode, Shape(1, element_size, 0, ()), optimizer=optimizer, world_size=world_size)
    return float(e.device), float(e.host)


def fits(e: Estimate, device_bytes: float | None, host_bytes: float | None, shared: bool) -> bool:
    """Whether ``e`` fits ``device_bytes`` and ``host_bytes`` (None: no limit); ``shared``: the
    device is the host (training on the CPU), so both totals come out of ``host_bytes``."""
    if shared:
        return host_bytes is None or e.device + e.host <= host_bytes
    return (device_bytes is None or e.device <= device_bytes) and (
        host_bytes is None or e.host <= host_bytes
    )


def largest_fitting(
    estimate_of: Callable[[Shape], Estimate],
    shape: Shape,
    device_bytes: float | None,
    host_bytes: float | None,
    shared: bool = False,
) -> int | None:
    """The most parameter elements of ``shape``'s kind whose ``estimate_of(shape)`` fits (see
    :func:`fits`); None when nothing limits it (no memory given, or none the mode uses)."""

    def ok(numel: int) -> bool:
        return fits(estimate_of(shape.scaled(numel)), device_bytes, host_bytes, shared)

    if not ok(1):
        return 0
    high = 1
    while ok(high * 2):
        high *= 2
        if high >= 2**62:
            return None
    low, high = high, high * 2
    while high - low > 1:  # ok(low), not ok(high)
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def table_rows(estimates: Sequence[Estimate], unit: float) -> list[list[str]]:
    """One row per estimate: its name, then every category, the device and host totals, in
    ``unit`` (bytes per ``unit``)."""
    rows = []
    for e in estimates:
        values = [e.bytes[c] for c in DEVICE_CATEGORIES] + [e.device]
        values += [e.bytes[c] for c in HOST_CATEGORIES] + [e.host]
        rows.append([e.mode.name, *(f"{v / unit:.2f}" for v in values)])
    return rows

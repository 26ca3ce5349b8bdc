"""Will my model fit? Device and host memory per rank for every configuration, before a run.

    python -m leanddp.plan --model gpt2 --world-size 8 --gpu-memory-gb 80 --host-memory-gb 512
    python -m leanddp.plan --params 7e9 --dtype bf16 --world-size 8 --accum 4 --gpu-memory-gb 80

From the memory model of docs/memory.md (``leanddp._memory``, which the bench's targets use too):
for torch's DDP and each leanddp configuration, the bytes one rank holds on the device
(parameters, gradients outside the buckets, buckets, optimizer state) and on the host (offloaded
state, float32 masters, staging buffers), whether that fits the memory given, and the largest
model of the same shape that would. Activations, the CUDA context and the allocator's cache are
not included: keep room for them (``--reserve-gb``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from . import _memory
from ._config import _caps
from ._extension import _C

GIB = 2**30
#: --optimizer's choices: what the fused kernels step (their state per element: _memory.MOMENTS)
OPTIMIZERS = tuple(_memory.MOMENTS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape_of(
    model: nn.Module | int,
    *,
    dtype: torch.dtype | None = None,
    bucket_cap_mb: float | None = None,
    first_layout: bool = False,
) -> _memory.Shape:
    """The memory model's view of ``model``, bucketed as leanddp's Reducer buckets it.

    A module with parameters of several dtypes is counted at the widest (an upper bound).

    Args:
        model: an ``nn.Module`` (on any device, ``meta`` included, so a model too large to
            build can be planned), or a parameter count (in buckets of the cap).
        dtype: the parameters' (default: the module's, or float32 for a count).
        bucket_cap_mb: as :class:`leanddp.DistributedDataParallel` takes it.
        first_layout: the buckets as first built (registration order; the configurations that
            keep them, ``Mode.keeps_first_layout``) rather than as rebuilt in gradient order.
    """
    caps = list(_caps(bucket_cap_mb, None))
    if isinstance(model, bool) or not isinstance(model, (int, nn.Module)):
        raise TypeError(f"model must be an nn.Module or a parameter count, got {type(model)}")
    if isinstance(model, int):
        if model < 1:
            raise ValueError(f"model: a parameter count must be positive, got {model}")
        size = torch.empty((), dtype=dtype or torch.float32).element_size()
        return _memory.Shape.filled(model, size, 1, caps[-1])
    params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if dtype is not None:
        params = [torch.empty(p.shape, dtype=dtype, device="meta") for p in params]
    sizes = {p.element_size() for p in params}
    # rebuilt: filled in the order gradients come, last-registered first (a module's usual
    # order); first built: in registration order
    order = list(range(len(params))) if first_layout else list(reversed(range(len(params))))
    groups = _C.assign_buckets(params, order, caps)
    buckets = [sum(params[i].numel() * params[i].element_size() for i in g) for g in groups]
    numel = sum(p.numel() for p in params)
    plain8 = sum(
        p.numel()
        for p in params
        if p.numel() < _memory.QUANT_MIN or p.numel() % _memory.QUANT_BLOCK
    )
    return _memory.Shape.of(numel, max(sizes), len(params), buckets, plain8)


@dataclasses.dataclass
class Plan:
    """The planner's answer: an estimate per configuration, whether it fits, and the largest
    model of the same shape that would (parameter elements; None where no memory was given).

    Args:
        shape: the model as the memory model sees it (:func:`shape_of`).
        estimates: bytes per rank by category, one per configuration.
        fits: per configuration: fits the memory given (None: none given).
        largest: per configuration: parameter elements of the largest model that fits.
        settings: the arguments of :func:`plan` that produced it.
    """

    shape: _memory.Shape
    estimates: list[_memory.Estimate]
    fits: dict[str, bool | None]
    largest: dict[str, int | None]
    settings: dict[str, object]

    @property
    def unit(self) -> tuple[str, int]:
        """GiB where the largest figure exceeds 10 GiB, else MiB."""
        top = max(max(e.device, e.host) for e in self.estimates)
        return ("GiB", GIB) if top > 10 * GIB else ("MiB", 2**20)

    def table(self) -> str:
        """A markdown table: bytes per rank by category (in ``unit``), fits, largest model."""
        header = [
            "configuration", "parameters", "gradients", "buckets", "optimizer state",
            "device total", "host state", "host masters", "host staging", "host accumulation",
            "host total",
            "fits", "largest model",
        ]  # fmt: skip
        lines = [
            "| " + " | ".join(header) + " |",
            "|---" + "|---:" * (len(header) - 2) + "|---:|",
        ]
        for row, e in zip(
            _memory.table_rows(self.estimates, self.unit[1]), self.estimates, strict=True
        ):
            fit = self.fits[e.mode.name]
            most = self.largest[e.mode.name]
            row += ["—" if fit is None else "yes" if fit else "**no**", _count(most)]
            lines.append("| " + " | ".join(row) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        s = self.settings
        intro = (
            f"{_count(self.shape.numel)} parameters ({self.shape.element_size} bytes each, "
            f"{self.shape.tensors} tensors, {self.shape.bucket_count} buckets of up to "
            f"{self.shape.largest_bucket / 2**20:.2f} MiB), {s['optimizer']}, world size "
            f"{s['world_size']}, accumulation {s['accumulation']}"
            + (", clipping" if s["clip"] else "")
            + f", on {'a GPU' if s['device_ordered'] else 'the CPU'}; {self.unit[0]} per rank"
            + (f"; device memory {s['gpu_memory_gb']:.1f} GiB" if s["gpu_memory_gb"] else "")
            + (f" less {s['reserve_gb']} GiB reserved" if s["reserve_gb"] else "")
            + (f"; host memory {s['host_memory_gb']:.1f} GiB" if s["host_memory_gb"] else "")
            + ". Activations are not included."
        )
        return intro + "\n\n" + self.table()


def _count(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def plan(
    model: nn.Module | int,
    *,
    optimizer: str = "adamw",
    world_size: int = 1,
    accumulation: int = 1,
    bucket_cap_mb: float | None = None,
    dtype: torch.dtype | None = None,
    clip: bool = False,
    gpu_memory_gb: float | None = None,
    host_memory_gb: float | None = None,
    reserve_gb: float = 0.0,
    device: str = "cuda",
    configs: Sequence[str] | None = None,
) -> Plan:
    """Memory per rank of every configuration, and whether it fits.

    Args:
        model: an ``nn.Module`` (any device, ``meta`` included) or a parameter count.
        optimizer: one of ``OPTIMIZERS`` (``"adamw"``, ``"adam"``, ``"sgd"``, ...).
        world_size: ranks (shard_optimizer_state keeps 1/N of the state on each).
        accumulation: micro-batches per step.
        bucket_cap_mb: as :class:`leanddp.DistributedDataParallel` takes it.
        dtype: the parameters' (default: the module's, or float32 for a count).
        clip: clipping with ``max_grad_norm``.
        gpu_memory_gb: device memory per rank: says whether each configuration fits, and the
            largest model of the same shape that would.
        host_memory_gb: host memory per rank, likewise.
        reserve_gb: kept out of ``gpu_memory_gb`` for activations and the CUDA context.
        device: ``"cuda"`` or ``"cpu"`` (a sharded bucket waits longer on the CPU, where the
            device memory is the host's).
        configs: names of the configurations (``_memory.MODES``; default: all).

    Returns:
        A :class:`Plan`: ``str(plan)`` is the table ``python -m leanddp.plan`` prints.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    for name, value in (("gpu_memory_gb", gpu_memory_gb), ("host_memory_gb", host_memory_gb)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if reserve_gb < 0:
        raise ValueError(f"reserve_gb must not be negative, got {reserve_gb}")
    modes = {m.name: m for m in _memory.MODES}
    unknown = [c for c in configs or () if c not in modes]
    if unknown:
        raise ValueError(f"configs: unknown {unknown}; choose from {list(modes)}")
    shapes = {
        first: shape_of(model, dtype=dtype, bucket_cap_mb=bucket_cap_mb, first_layout=first)
        for first in (False, True)
    }
    shape = shapes[False]
    shared = device == "cpu"  # training on the CPU: the device memory is the host's
    if shared and gpu_memory_gb is not None:
        raise ValueError(
            "gpu_memory_gb: on the CPU the device memory is the host's; give host_memory_gb only"
        )
    device_bytes = None if gpu_memory_gb is None else (gpu_memory_gb - reserve_gb) * GIB
    host_bytes = None if host_memory_gb is None else (host_memory_gb - shared * reserve_gb) * GIB
    settings = dict(
        optimizer=optimizer,
        world_size=world_size,
        accumulation=accumulation,
        clip=clip,
        device_ordered=device == "cuda",
        gpu_memory_gb=gpu_memory_gb,
        host_memory_gb=host_memory_gb,
        reserve_gb=reserve_gb,
    )
    estimates, fits, largest = [], {}, {}
    for name in configs or list(modes):
        of = _estimator(modes[name], optimizer, world_size, accumulation, clip)
        layout = shapes[modes[name].keeps_first_layout]
        e = of(layout)
        estimates.append(e)
        limited = device_bytes is not None or host_bytes is not None
        fits[name] = _memory.fits(e, device_bytes, host_bytes, shared) if limited else None
        largest[name] = _memory.largest_fitting(of, layout, device_bytes, host_bytes, shared)
    return Plan(shape, estimates, fits, largest, settings)


def _estimator(
    mode: _memory.Mode, optimizer: str, world: int, accum: int, clip: bool
) -> Callable[[_memory.Shape], _memory.Estimate]:
    def of(shape: _memory.Shape) -> _memory.Estimate:
        return _memory.estimate(
            mode,
            shape,
            optimizer=optimizer,
            world_size=world,
            accumulation=accum,
            clip=clip,
        )

    return of


def _model_from(spec: str) -> nn.Module:
    """``tiny``/``gpt2`` (the bench's GPT-style models) or ``package.module:callable``, built on
    the meta device (no memory)."""
    with torch.device("meta"):
        if ":" not in spec:
            from .bench._model import SIZES, TinyGPT

            if spec not in SIZES:
                raise SystemExit(
                    f"--model: {spec!r} is neither of {list(SIZES)} nor module:callable"
                )
            return TinyGPT(SIZES[spec])
        module, _, attr = spec.partition(":")
        built: nn.Module = getattr(importlib.import_module(module), attr)()
        return built


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m leanddp.plan", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model",
        help="tiny or gpt2 (GPT-2 small; the bench's models), or package.module:callable "
        "returning the nn.Module (built on the meta device)",
    )
    what.add_argument("--params", type=float, help="a parameter count instead of a model (7e9)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the model's")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--world-size", type=int, default=1, help="ranks (default 1)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="default: DDP's, 25")
    p.add_argument("--clip", action="store_true", help="max_grad_norm is set")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="device memory per rank")
    p.add_argument("--host-memory-gb", type=float, default=None, help="host memory per rank")
    p.add_argument("--reserve-gb", type=float, default=0.0, help="device memory kept free")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    for name in ("world_size", "accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    model: nn.Module | int = _model_from(args.model) if args.model else int(args.params)
    try:
        result = plan(
            model,
            optimizer=args.optimizer,
            world_size=args.world_size,
            accumulation=args.accum,
            bucket_cap_mb=args.bucket_cap_mb,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            clip=args.clip,
            gpu_memory_gb=args.gpu_memory_gb,
            host_memory_gb=args.host_memory_gb,
            reserve_gb=args.reserve_gb,
            device=args.device,
        )
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    print(result)


if __name__ == "__main__":
    main(sys.argv[1:])

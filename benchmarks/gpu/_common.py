"""What the GPU suite's benchmarks share: the one-process world, the configurations, verdicts."""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from leanddp.bench._env import environment
from leanddp.bench._model import SIZES, ModelSize, TinyGPT
from leanddp.bench._worker import CONFIGS as BENCH_CONFIGS
from leanddp.bench._worker import (  # noqa: F401 (as the demo's)
    DEVICE_ACCUMULATION,
    SHARDED,
    SHARDED_OFFLOAD,
    build,
)

#: The demo's configurations these benchmarks compare with torch's DDP + AdamW (the 8-bit ones,
#: whose anchor is torchao's AdamW8bit, are the demo's --lowbit runs)
CONFIGS = {name: config for name, config in BENCH_CONFIGS.items() if not config.lowbit}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: ``LEANDDP_GPU_SMOKE=1`` runs the benchmarks as ``--smoke`` does: CPU, tiny model, few steps.
SMOKE_ENV = "LEANDDP_GPU_SMOKE"
SMOKE_NOTE = "(cpu smoke: not a target)"
#: torch's default bucket cap, and a smaller one that gives a smoke run's tiny model 13 buckets
BUCKET_CAP_MB = 25.0
SMOKE_BUCKET_CAP_MB = 1.0
DEFAULT_OUT = Path(os.environ.get("OUT", "benchmarks/out/gpu"))


def log(prefix: str, msg: str) -> None:
    """A progress line on stderr."""
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every benchmark of the suite takes."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"CPU, tiny model, few steps: checks the script (or {SMOKE_ENV}=1)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        help=f"default: torch's {BUCKET_CAP_MB:g} ({SMOKE_BUCKET_CAP_MB:g} with --smoke)",
    )
    parser.add_argument("--lr", type=float, default=1e-4)


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Checks what the parsers cannot (exit code 2 before any work); the device to run on."""
    args.smoke = args.smoke or os.environ.get(SMOKE_ENV, "0") == "1"
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = SMOKE_BUCKET_CAP_MB if args.smoke else BUCKET_CAP_MB
    if args.bucket_cap_mb <= 0:
        parser.error(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        parser.error(f"no GPU is visible: run with --smoke (or {SMOKE_ENV}=1) for the CPU check")
    return torch.device("cuda", torch.cuda.current_device())


def parse_list(parser: argparse.ArgumentParser, text: str, option: str, allowed=None) -> list[str]:
    """``a,b,c`` -> a list; an empty item or one not in ``allowed`` is a usage error."""
    items = [s.strip() for s in text.split(",")]
    for item in items:
        if not item or (allowed is not None and item not in allowed):
            choices = f" (choose from {', '.join(allowed)})" if allowed is not None else ""
            parser.error(f"{option}: invalid item {item!r} in {text!r}{choices}")
    return items


def parse_positive_ints(parser: argparse.ArgumentParser, text: str, option: str) -> list[int]:
    """``1,4`` -> [1, 4]; anything else is a usage error."""
    items = parse_list(parser, text, option)
    if not all(s.isdigit() and int(s) > 0 for s in items):
        parser.error(f"{option}: expected positive integers separated by commas, got {text!r}")
    return [int(s) for s in items]


def init_world(device: torch.device) -> None:
    """World size 1 on a free local port: NCCL on a GPU, gloo on the CPU; plain ``python``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def sync(cuda: bool) -> None:
    """Waits for the GPU's queued work (nothing to do on the CPU)."""
    if cuda:
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    """Returns what the last configuration left to the allocator, and the cache to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def start(args: argparse.Namespace) -> tuple[ModelSize, nn.Module, torch.Generator]:
    """The world, the model size, the model every configuration starts from (its weights), and
    the generator of the batches every configuration sees."""
    init_world(args.device)
    size = SIZES[args.model]
    torch.manual_seed(0)
    master = TinyGPT(size)
    return size, master, torch.Generator().manual_seed(1)


def fresh_copy(master: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of ``master`` (same initial weights every time) on ``device`` in ``dtype``."""
    return copy.deepcopy(master).to(device=device, dtype=dtype)


def storages_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(opt: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct storages behind an optimizer's state tensors."""
    if opt is None:
        return 0
    return storages_bytes(
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


def torch_bucket_bytes(ddp: nn.Module) -> list[int]:
    """Bytes of each bucket of torch's DDP (or leanddp's), from the logging data both share:
    torch's DDP builds one bucket at construction and its real ones after the first iteration."""
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
    return [int(b) for b in sizes.split(",") if b.strip()]


def verdict(subject: str, target: str, passed: bool, smoke: bool, word: str = "") -> dict:
    """One target's line, ``VERDICT <subject> (<target>) PASS|FAIL``; marked in a smoke run."""
    line = (
        f"VERDICT {subject} ({target}) {word + ' ' if word else ''}{'PASS' if passed else 'FAIL'}"
    )
    return dict(line=f"{line} {SMOKE_NOTE}" if smoke else line, passed=bool(passed), smoke=smoke)


def write_json(out: Path, name: str, payload: dict) -> Path:
    """``payload`` as ``out/name.json`` (directories made as needed)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def report(argv: list[str], args: argparse.Namespace, began: float, **fields) -> dict:
    """A benchmark's JSON: the environment, how it ran, how long it took, and ``fields``."""
    command = "python " + " ".join([sys.argv[0], *argv])
    arguments = {
        k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()
    }
    return dict(
        env=environment(command),
        smoke=args.smoke,
        device=str(args.device),
        seconds=time.perf_counter() - began,
        args=arguments,
        **fields,
    )

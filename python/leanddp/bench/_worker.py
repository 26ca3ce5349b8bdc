"""One configuration of ``python -m leanddp.bench``, run by torchrun on every rank.

Trains the benchmark model for ``--warmup`` + ``--steps`` steps of ``--accum`` micro-batches
each (the first ``accum - 1`` under ``no_sync()``, every micro-batch loss divided by ``accum``,
so every configuration takes the same steps), then one more step with probes that measure
memory by category; a leanddp configuration then alternates ``--steps`` steps with torch's
DDP + AdamW(fused=True) on the same model and data, for its step time against torch's measured
in the same processes. Rank 0 writes the result as JSON to ``--result``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import leanddp
from leanddp import _memory
from leanddp._lifetime import leave
from leanddp._stats import storage_bytes
from leanddp.bench._model import DATA, SIZES, TinyGPT, batches, loss_of, markov_batches


class Config(NamedTuple):
    """How one configuration wraps the model (every one trains with AdamW(fused=True))."""

    wrapper: str
    """``"torch"`` (torch's DDP) or ``"leanddp"``."""
    views: bool
    """``gradient_as_bucket_view``."""
    in_backward: bool
    """``optimizer_in_backward``: the AdamW steps each bucket inside backward."""
    offload: bool
    """``offload_to_cpu``."""
    shard: bool = False
    """``shard_optimizer_state``: each rank steps, and keeps AdamW state for, 1/N of a bucket."""
    on_host: bool = True
    """offload_to_cpu: ``accumulate_on_host`` (no_sync() micro-batches summed on the host)."""
    lowbit: bool = False
    """torchao's ``AdamW8bit`` (8-bit state) instead of ``AdamW(fused=True)``."""


#: The in-backward configuration with shard_optimizer_state.
SHARDED = "leanddp in-backward sharded"
#: The offload_to_cpu configuration with shard_optimizer_state (each host holds 1/N).
SHARDED_OFFLOAD = "leanddp offload sharded"
#: offload_to_cpu with accumulate_on_host=False: no_sync() keeps the gradients on the device.
DEVICE_ACCUMULATION = "leanddp + offload_to_cpu, accumulating on the device"
#: The 8-bit configurations (``--lowbit``, torchao's AdamW8bit; the memory model's names), their
#: anchor first: torch's DDP + AdamW8bit, what a user runs today.
LOWBIT_CONFIGS = list(_memory.LOWBIT_CONFIGS)
LOWBIT_ANCHOR = LOWBIT_CONFIGS[0]
CONFIGS = {
    "torch DDP": Config("torch", False, False, False),
    "torch DDP + views": Config("torch", True, False, False),
    "leanddp": Config("leanddp", True, False, False),
    "leanddp + optimizer_in_backward": Config("leanddp", True, True, False),
    "leanddp + offload_to_cpu": Config("leanddp", True, True, True),
    SHARDED: Config("leanddp", True, True, False, shard=True),
    SHARDED_OFFLOAD: Config("leanddp", True, True, True, shard=True),
    DEVICE_ACCUMULATION: Config("leanddp", True, True, True, on_host=False),
}
# each 8-bit configuration: the configuration it runs as, with torchao's AdamW8bit
CONFIGS.update(
    {name: CONFIGS[mode]._replace(lowbit=True) for name, mode in _memory.LOWBIT_CONFIGS.items()}
)


def anchor_of(name: str) -> str:
    """The configuration ``name``'s step time is measured against, interleaved: torch's DDP
    with the same optimizer."""
    return LOWBIT_ANCHOR if CONFIGS[name].lowbit else "torch DDP"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[leanddp.bench]   {msg}", file=sys.stderr, flush=True)


Wrapped = nn.parallel.DistributedDataParallel  # torch's DDP, or leanddp's (a subclass)


def build(
    name: str, model: nn.Module, args: argparse.Namespace, device: torch.device
) -> tuple[Wrapped, torch.optim.Optimizer | None]:
    """The wrapped model and the optimizer the loop steps (None: stepped inside backward)."""
    wrapper, views, in_backward, offload, shard, on_host, lowbit = CONFIGS[name]
    adamw: Callable[..., torch.optim.Optimizer]
    if lowbit:
        from torchao.optim import AdamW8bit

        adamw = functools.partial(AdamW8bit, lr=args.lr)
    else:
        adamw = functools.partial(torch.optim.AdamW, lr=args.lr, fused=True)
    kw = dict(bucket_cap_mb=args.bucket_cap_mb)
    if device.type == "cuda":
        kw["device_ids"] = [device.index]
    if wrapper == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=views, **kw)
        return ddp, adamw(ddp.parameters())
    if in_backward:
        kw.update(optimizer_in_backward=adamw, offload_to_cpu=offload)
        if offload:
            kw["accumulate_on_host"] = on_host
        if shard:
            kw["shard_optimizer_state"] = True
        return leanddp.DistributedDataParallel(model, **kw), None
    ddp = leanddp.DistributedDataParallel(model, **kw)
    return ddp, adamw(ddp.parameters())


def train_step(
    ddp: Wrapped,
    opt: torch.optim.Optimizer | None,
    batch: torch.Tensor,
    accum: int,
    after_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; returns the step's mean loss."""
    total = torch.zeros((), device=batch.device)
    for i, micro in enumerate(batch.chunk(accum)):
        sync = i == accum - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = loss_of(ddp, micro) / accum
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        total += loss.detach()
    if after_backward is not None:
        after_backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return total


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's state."""
    return storage_bytes(
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


def measure(
    name: str, ddp: Wrapped, opt: torch.optim.Optimizer | None, batch: torch.Tensor, accum: int
) -> dict[str, int]:
    """One more step that measures gradients, buckets and optimizer state (bytes, rank 0)."""
    wrapper, _, in_backward, offload, *_ = CONFIGS[name]
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    out = {"parameters": storage_bytes(params), "host": 0}
    if wrapper == "torch":

        def probe() -> None:  # gradients are complete: torch's buckets live for the whole run
            buckets = ddp._get_ddp_logging_data().get("bucket_sizes", "")  # type: ignore[no-untyped-call]  # unannotated in torch
            out["buckets"] = sum(int(b) for b in str(buckets).split(",") if b.strip())
            grads = [p.grad for p in params if p.grad is not None]
            # with views, param.grad lies inside a bucket: only storages beyond those count
            out["gradients"] = 0 if ddp.gradient_as_bucket_view else storage_bytes(grads)

        train_step(ddp, opt, batch, accum, probe)
        assert opt is not None  # (torch's DDP: the loop steps the optimizer)
        out["optimizer_device"] = state_bytes(opt)
        return out
    assert isinstance(ddp, leanddp.DistributedDataParallel)  # (not torch's: leanddp's)
    peak = {"buckets": 0, "gradients": 0}

    def sample(_: torch.Tensor | None = None) -> None:  # the most held at once during backward
        s = ddp.memory_stats()
        peak["buckets"] = max(peak["buckets"], s["bucket_bytes"])
        peak["gradients"] = max(peak["gradients"], s["grad_bytes"])

    handles = [p.register_post_accumulate_grad_hook(sample) for p in params]
    train_step(ddp, opt, batch, accum, sample)
    for h in handles:
        h.remove()
    s = ddp.memory_stats()
    out["buckets"] = max(peak["buckets"], s["peak_bucket_bytes"])
    out["gradients"] = peak["gradients"]
    if not in_backward:
        assert opt is not None  # (the loop steps the optimizer)
        out["optimizer_device"] = state_bytes(opt)
    elif offload:
        out["optimizer_device"] = 0
        out["host"] = (
            s["optimizer_state_bytes"]
            + s["host_master_bytes"]
            + s["host_buffer_bytes"]
            + s["host_accumulation_bytes"]
        )
        out["host_accumulation"] = s["host_accumulation_bytes"]
    else:  # with shard_optimizer_state: this rank's shard
        out["optimizer_device"] = s["optimizer_state_bytes"]
    out["largest_bucket"] = max(ddp.reducer.bucket_bytes(), default=0)
    return out


def timed_step(
    ddp: Wrapped,
    opt: torch.optim.Optimizer | None,
    batch: torch.Tensor,
    accum: int,
    device: torch.device,
) -> float:
    """Seconds of one training step, its device work and (offload_to_cpu) its host step
    included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    train_step(ddp, opt, batch, accum)
    if isinstance(ddp, leanddp.DistributedDataParallel):
        ddp.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved(
    args: argparse.Namespace,
    ddp: Wrapped,
    opt: torch.optim.Optimizer | None,
    data: list[torch.Tensor],
    device: torch.device,
) -> dict[str, Any]:
    """This configuration's steps alternating with its anchor's (torch's DDP + the same
    optimizer: AdamW(fused=True), or torchao's AdamW8bit) on the same model and data, in the
    same processes (one step of each per round, which goes first alternating), so both see the
    same machine at the same moments: the step time ratio against torch's DDP, free of the
    drift between separate launches."""
    torch.manual_seed(0)
    model = TinyGPT(SIZES[args.model]).to(device=device, dtype=DTYPES[args.dtype])
    anchor = anchor_of(args.config)
    ref, ref_opt = build(anchor, model, args, device)
    contenders = [(ddp, opt), (ref, ref_opt)]
    times: list[list[float]] = [[], []]
    for i in range(1 + args.steps):  # round 0 warms torch's side up, untimed
        batch = data[i % len(data)]
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            seconds = timed_step(*contenders[k], batch, args.accum, device)
            if i > 0:
                times[k].append(seconds)
        if (i + 1) % max(1, (1 + args.steps) // 2) == 0:
            log(f"interleaved with {anchor}: round {i + 1}/{1 + args.steps}")
    ours, torch_ddp = (statistics.median(t) for t in times)
    return dict(ours=times[0], torch=times[1], ratio=ours / torch_ddp, anchor=anchor)


def host_overlap(
    ddp: Wrapped,
    opt: torch.optim.Optimizer | None,
    data: list[torch.Tensor],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """offload_to_cpu: the worker's busy time and the loop's waits for it over
    ``args.host_steps`` more steps. The share of the host step hidden is a ratio of a few ms per
    step on the CPU, where one stall of the worker (ranks sharing cores) is a large part of a few
    steps: it needs more steps than the step time does."""
    assert isinstance(ddp, leanddp.DistributedDataParallel)  # (offload_to_cpu: leanddp's)
    before = ddp.offload_stats()
    for i in range(args.host_steps):
        train_step(ddp, opt, data[i % len(data)], args.accum)
        if (i + 1) % max(1, args.host_steps // 4) == 0:
            log(f"host step overlap: step {i + 1}/{args.host_steps}")
    ddp.synchronize()  # the last step's host work counts with it
    after = ddp.offload_stats()
    host = {k: after[k] - before[k] for k in ("step_seconds", "wait_seconds", "buckets")}
    return dict(host, steps=args.host_steps)


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(args: argparse.Namespace) -> dict[str, Any]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    size = SIZES[args.model]
    if args.data == "markov":  # a new batch each training step; the later loops take them again
        data = markov_batches(size, dist.get_rank(), args.warmup + args.steps, device)
    else:
        data = batches(size, dist.get_rank(), 4, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    else:
        base_mem = rss_bytes()
    torch.manual_seed(0)
    model = TinyGPT(size).to(device=device, dtype=DTYPES[args.dtype])
    ddp, opt = build(args.config, model, args, device)
    losses = []
    offload = CONFIGS[args.config].offload
    marks = []  # the start of each timed step, and the end of the last one
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
        if i >= args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.append(time.perf_counter())
        losses.append(train_step(ddp, opt, data[i % len(data)], args.accum))
        if (i + 1) % max(1, (args.warmup + args.steps) // 4) == 0:
            log(f"step {i + 1}/{args.warmup + args.steps}  loss {losses[-1].item():.4f}")
    if offload:
        assert isinstance(ddp, leanddp.DistributedDataParallel)  # (offload_to_cpu: leanddp's)
        ddp.synchronize()  # the last step's host work belongs to the timed steps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    marks.append(time.perf_counter())
    # Each step's time, start to start: host work that overlaps the next step counts once.
    step_times = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base_mem
    else:  # ru_maxrss is in KiB on Linux: the high-water mark of the run so far
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_mem
    host = host_overlap(ddp, opt, data, args) if offload else None
    memory = measure(args.config, ddp, opt, data[0], args.accum)
    memory["peak_process"] = peak
    # (after the memory is measured: torch's side adds its own)
    versus = (
        None
        if CONFIGS[args.config].wrapper == "torch"
        else interleaved(args, ddp, opt, data, device)
    )
    result = dict(
        config=args.config,
        accum=args.accum,
        step_seconds=statistics.median(step_times),
        step_times=step_times,
        losses=[float(x) for x in torch.stack(losses).cpu()],
        memory=memory,
        host_step=host,
        interleaved=versus,
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
    )
    # The wrappers let go of their process groups first, so that tearing the group down ends
    # gloo's threads here, not at interpreter exit.
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-steps", type=int, default=100)
    p.add_argument("--model", choices=list(SIZES), default="tiny")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--bucket-cap-mb", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", choices=list(DATA), default="repeat")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--result", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    outcome = run(arguments)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(arguments.result, "w") as f:
            json.dump(outcome, f)
    leave()

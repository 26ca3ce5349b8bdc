"""Benchmark leanddp.DistributedDataParallel against torch's DDP: step time and memory.

    python benchmarks/bench_ddp.py [--world-size 2] [--rounds 5] [--steps 10]
                                   [--bucket-cap-mb 2] [--out DIR]

A small GPT-style transformer is trained on synthetic tokens with gloo on CPU, world size 2,
under five configurations built in the same processes, all with AdamW: torch's DDP
(gradient_as_bucket_view False, torch's default) and torch's DDP with views, each followed by
torch.optim.AdamW(fused=True); leanddp (views, its default) followed by the same optimizer;
leanddp with optimizer_in_backward=AdamW (stepped bucket by bucket inside backward by leanddp's
fused kernel); and the same with offload_to_cpu=True (state and master weights in host memory,
stepped by leanddp's worker thread while backward goes on). Each round times --steps training
steps (forward, backward, optimizer step; with offload_to_cpu up to the last host step) of
every configuration in turn; the table gives the median step time over rounds and its ratio to
torch's DDP with views (the anchor measured in the same run). For offload_to_cpu it also gives
the share of the host step hidden behind the rest of the step: 1 - (time the loop waited for
the worker) / (the worker's busy time), from ddp.offload_stats() over the timed rounds. Every
configuration uses the same bucket cap, 2 MiB by default: the model is 14 MiB, and torch's
default of 25 MiB would put it in one bucket (at GPT-2-small scale, 25 MiB buckets give a similar
count of about 20).

Memory is measured, not derived. Gradient memory: the bytes of the distinct storages behind
every param.grad and every communication bucket (torch's buckets are seen through a comm hook
that records each bucket's buffer and then runs torch's default allreduce); with
optimizer_in_backward, where gradients are released during backward, its peak is sampled at
every gradient accumulation hook of one step (the Reducer's accounting of buckets and
gradients it holds). Optimizer state: the distinct storages behind the optimizer's state. With
offload_to_cpu, the state, the float32 master weights and the staging buffers are host memory
(ddp.memory_stats()), shown apart from what sits beside the model: on a GPU that is the device
memory saved; on this CPU-only run both are the same RAM.
Prints progress, then a markdown table; writes bench_ddp.json and bench_ddp.png into --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_ops import environment  # the same machine/version record as the op benchmark
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 2048, 256, 4, 4, 64, 8
CONFIGS = [
    "torch DDP",
    "torch DDP + views",
    "leanddp",
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
]
IN_BACKWARD, OFFLOAD = CONFIGS[3], CONFIGS[4]
ANCHOR = "torch DDP + views"
LR = 1e-3
#: The torch configurations share torch's AdamW and agree bitwise. leanddp's fused AdamW rounds
#: differently from torch's (a few ulp per step); AdamW turns noise-level gradients (attention key
#: biases, whose exact gradient is zero) into full-size steps, so over ~100 steps the final loss
#: drifts by up to a few 1e-3 relative. The parity tests hold the strict bound (1e-5, 5 steps).
LOSS_TOLERANCE = 1e-2


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, tied output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        layer = nn.TransformerEncoderLayer(
            DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        h = self.norm(self.blocks(h, is_causal=True, mask=_causal(tokens.shape[1])))
        return h @ self.tok.weight.T


def _causal(n: int) -> torch.Tensor:
    return torch.triu(torch.full((n, n), float("-inf")), diagonal=1)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench_ddp] {msg}", file=sys.stderr, flush=True)


def build(
    name: str, model: nn.Module, cap_mb: float, threads: int = 1
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The DDP wrapper and the optimizer the loop steps (None: stepped inside backward)."""
    group = dist.new_group()
    adamw = functools.partial(torch.optim.AdamW, lr=LR, fused=True)
    if name in (IN_BACKWARD, OFFLOAD):
        offload = dict(offload_to_cpu=True, offload_threads=threads) if name == OFFLOAD else {}
        ddp = leanddp.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=cap_mb, optimizer_in_backward=adamw, **offload
        )
        return ddp, None
    if name == "leanddp":
        ddp = leanddp.DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap_mb)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            process_group=group,
            bucket_cap_mb=cap_mb,
            gradient_as_bucket_view=name.endswith("views"),
        )
    return ddp, adamw(ddp.parameters())


def step(ddp: nn.Module, opt: torch.optim.Optimizer | None, tokens: torch.Tensor) -> torch.Tensor:
    if opt is not None:
        opt.zero_grad(set_to_none=False)
    logits = ddp(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    if opt is not None:
        opt.step()
    return loss.detach()


def gradient_bytes(ddp: nn.Module, bucket_storages: dict[int, int]) -> int:
    """Bytes of the distinct storages behind param.grad and the communication buckets."""
    storages = dict(bucket_storages)
    for p in ddp.module.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's state."""
    storages = {}
    for entry in opt.state.values():
        for v in entry.values():
            if isinstance(v, torch.Tensor):
                storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(storages.values())


def in_backward_peak(ddp: nn.Module, tokens: torch.Tensor) -> int:
    """One step with a sampler at every gradient accumulation: the most gradient bytes the
    Reducer held at once (buckets allocated + gradients outside them)."""
    peak = 0

    def sample(_: torch.Tensor) -> None:
        nonlocal peak
        s = ddp.memory_stats()
        peak = max(peak, s["bucket_bytes"] + s["grad_bytes"])

    handles = [p.register_post_accumulate_grad_hook(sample) for p in ddp.module.parameters()]
    step(ddp, None, tokens)
    for h in handles:
        h.remove()
    s = ddp.memory_stats()
    return max(peak, s["peak_bucket_bytes"])


def torch_bucket_storages(ddp: nn.Module, opt, tokens) -> dict[int, int]:
    """Runs one step of a torch DDP copy with a recording hook: {storage ptr: bytes}."""
    seen: dict[int, int] = {}

    def record(state, bucket):
        s = bucket.buffer().untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(ddp.process_group, record)
    step(ddp, opt, tokens)
    return seen


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: dict) -> None:
    threads = max(1, (os.cpu_count() or 2) // world_size)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    base = TinyGPT()
    runs = {}
    for name in CONFIGS:
        torch.manual_seed(0)
        model = TinyGPT()
        model.load_state_dict(base.state_dict())
        runs[name] = build(name, model, args.bucket_cap_mb, threads)
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]
    losses: dict[str, list[float]] = {n: [] for n in CONFIGS}
    for name, (ddp, opt) in runs.items():  # warm up: first iterations, bucket rebuilds
        for i in range(3):
            losses[name].append(step(ddp, opt, batches[i % 4]).item())
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    host_before = runs[OFFLOAD][0].offload_stats()
    for r in range(args.rounds):
        for name, (ddp, opt) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.steps):
                loss = step(ddp, opt, batches[i % 4])
            if name == OFFLOAD:
                ddp.synchronize()  # the last step's host work is part of the time
            times[name].append((time.perf_counter() - start) / args.steps)
            losses[name].append(loss.item())
        log(
            rank,
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in CONFIGS),
        )
    host_after = runs[OFFLOAD][0].offload_stats()
    host = {k: host_after[k] - host_before[k] for k in ("step_seconds", "wait_seconds", "buckets")}
    memory = {}
    for name, (ddp, opt) in runs.items():
        buckets: dict[int, int] = {}
        if name in (IN_BACKWARD, OFFLOAD):
            stats = ddp.memory_stats()
            memory[name] = {
                "optimizer": stats["optimizer_state_bytes"],
                "measured": in_backward_peak(ddp, batches[0]),
                "host": stats["optimizer_state_bytes"]
                + stats["host_master_bytes"]
                + stats["host_buffer_bytes"],
                "on_host": name == OFFLOAD,
            }
            continue
        memory[name] = {"optimizer": state_bytes(opt)}
        if name == "leanddp":
            stats = ddp.memory_stats()
            memory[name]["accounted"] = stats["bucket_bytes"] + stats["grad_bytes"]
        else:  # a fresh copy with a recording hook, so the timed one ran torch's C++ default
            ddp, _ = build(name, TinyGPT(), args.bucket_cap_mb)
            buckets = torch_bucket_storages(ddp, torch.optim.SGD(ddp.parameters()), batches[0])
        memory[name]["measured"] = gradient_bytes(ddp, buckets)
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    if rank == 0:
        out.update(
            times=times, memory=memory, param_bytes=param_bytes, losses=losses, host_step=host
        )
    dist.destroy_process_group()


def markdown(result: dict) -> str:
    t = {n: statistics.median(v) for n, v in result["times"].items()}
    pb = result["param_bytes"]
    env = result["env"]
    lines = [
        f"`{env['command']}` — torch {env['torch']}, Python {env['python']}, {env['cpu']}",
        "",
        f"model: {result['params'] / 1e6:.2f}M parameters ({pb / 2**20:.1f} MiB fp32), gloo, "
        f"world size {result['world_size']}, CPU, bucket_cap_mb={result['bucket_cap_mb']}",
        "",
        "| configuration | step (ms, median) | vs torch DDP + views | peak grad + bucket bytes "
        "| optimizer state | grad + optimizer beside the model, × parameter bytes "
        "| offloaded to the host |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in CONFIGS:
        m = result["memory"][n]
        mem, opt = m["measured"], m["optimizer"]
        beside = mem + (0 if m.get("on_host") else opt)
        host = f"{m['host'] / 2**20:.2f} MiB" if m.get("on_host") else "—"
        lines.append(
            f"| {n} | {t[n] * 1e3:.1f} | {t[n] / t[ANCHOR]:.3f} | {mem / 2**20:.2f} MiB "
            f"({mem / pb:.2f}×) | {opt / 2**20:.2f} MiB{' (host)' if m.get('on_host') else ''} "
            f"| {beside / pb:.2f} | {host} |"
        )
    h = result["host_step"]
    hidden = 1 - h["wait_seconds"] / h["step_seconds"] if h["step_seconds"] > 0 else 0.0
    lines.append("")
    lines.append(
        f"offload_to_cpu host step (rank 0, timed rounds): worker busy {h['step_seconds']:.3f} s "
        f"over {h['buckets']} bucket steps, loop waited {h['wait_seconds']:.3f} s: "
        f"{hidden:.0%} of the host step hidden behind backward and the loop"
    )
    lines.append("")
    lines.append(
        f"vs torch's default DDP (views off): leanddp {t['leanddp'] / t['torch DDP']:.3f}×, "
        f"+ optimizer_in_backward {t[IN_BACKWARD] / t['torch DDP']:.3f}× step time; leanddp's "
        f"gradients accounted by ddp.memory_stats(): "
        f"{result['memory']['leanddp']['accounted'] / pb:.2f}× parameter bytes"
    )
    final = {n: v[-1] for n, v in result["losses"].items()}
    spread = max(abs(v - final[ANCHOR]) for v in final.values()) / abs(final[ANCHOR])
    verdict = "agree" if spread <= LOSS_TOLERANCE else "DIFFER"
    lines.append(
        f"final losses (rank 0): {', '.join(f'{n} {v:.5f}' for n, v in final.items())} — "
        f"{verdict} (largest relative difference {spread:.1e}, tolerance {LOSS_TOLERANCE:.0e})"
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_ddp] matplotlib is not installed: no PNG written", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    labels = [n.replace(" + ", "\n+ ") for n in CONFIGS]
    mem = result["memory"]
    grads = [mem[n]["measured"] / 2**20 for n in CONFIGS]
    state = [0 if mem[n].get("on_host") else mem[n]["optimizer"] / 2**20 for n in CONFIGS]
    host = [mem[n]["host"] / 2**20 if mem[n].get("on_host") else 0 for n in CONFIGS]
    ms = [statistics.median(result["times"][n]) * 1e3 for n in CONFIGS]
    ax1.bar(labels, grads, color="#2a7", label="peak gradients + buckets")
    ax1.bar(labels, state, bottom=grads, color="#79c", label="optimizer state")
    top = [g + s for g, s in zip(grads, state, strict=True)]
    ax1.bar(labels, host, bottom=top, color="#ddd", hatch="//", label="offloaded to the host")
    ax1.axhline(result["param_bytes"] / 2**20, ls="--", c="k", lw=1, label="parameter bytes")
    ax1.set_ylabel("MiB")
    ax1.legend(fontsize=8)
    ax2.bar(labels, ms, color=["#888", "#aaa", "#2a7", "#1a5", "#174"])
    ax2.set_ylabel("step time (ms, median)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
        plt.setp(ax.get_xticklabels(), rotation=12, ha="right")
    fig.suptitle(f"leanddp vs torch DDP — CPU gloo, world size {result['world_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args(argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args.world_size, port, args, out), nprocs=args.world_size)
        result = dict(out)
    result["world_size"] = args.world_size
    result["bucket_cap_mb"] = args.bucket_cap_mb
    result["params"] = sum(p.numel() for p in TinyGPT().parameters())
    result["env"] = environment(argv)
    table = markdown(result)
    print(table)
    (args.out / "bench_ddp.json").write_text(json.dumps(result, indent=2, default=str))
    if plot(result, args.out / "bench_ddp.png"):
        print(f"[bench_ddp] wrote {args.out / 'bench_ddp.png'}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)

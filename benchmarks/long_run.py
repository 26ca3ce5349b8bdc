"""Long-run reliability check: leanddp against torch's DDP for 1000+ steps, every feature on.

Each configuration runs in 2 fresh gloo processes (torch.multiprocessing spawn), one thread
each. In every process torch's DistributedDataParallel + a torch optimizer and
leanddp.DistributedDataParallel train copies of one small model on their own process groups, on
the same data, with tiny buckets and 2 micro-batches per step (the first under no_sync()). Every
``--checkpoint-every`` steps and at the end it records (a) the largest relative difference of
leanddp's parameters from torch's (per tensor, max|ours - torch| / max|torch|) and whether the
ranks hold identical parameters, and (b) each rank's resident memory (VmRSS after
gc.collect()) and leanddp's memory_stats(). Writes long_run.md and long_run.json into ``--out``
and exits non-zero if parameters diverge beyond a configuration's tolerance, ranks disagree,
or RSS grows more than ``--max-rss-growth-mb`` from the first checkpoint to the end.

    PYTHONPATH=python python benchmarks/long_run.py [--steps 1000] [--configs everything ...]

``--unused-pattern synced`` keeps the dynamic branch out of no_sync-only micro-batches (by
default some steps use it only there, which torch's DDP counts as used in that step).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import leanddp
from leanddp.bench._env import environment

IN, OUT, BATCH, ACCUM = 32, 16, 16, 2
#: Tolerance of the configurations stepped by leanddp's fused AdamW kernels (device or host).
REL_TOL = 1e-5
TOLERANCE_NOTE = (
    "views: bitwise equal to torch (same reduction, same torch.optim.AdamW). optimizer_in_backward"
    " and offload_to_cpu step with leanddp's fused AdamW kernels, whose rounding differs from "
    "torch.optim.AdamW's in the last bits; with the defaults the drift measured 4.6e-7 at step "
    "100 and at most 1.1e-6 by step 1000, so 1e-5 leaves a 9x margin, while one missed or "
    "extra step shows as 1e-3 or more (raise --rel-tol for much longer runs)"
)
#: name -> what the configuration turns on. tol 0.0: bitwise equal to torch; None: --rel-tol.
CONFIGS = {
    "everything": dict(
        about="optimizer_in_backward(AdamW) + offload_to_cpu + max_grad_norm + no_sync "
        "accumulation + find_unused_parameters (a branch some steps/ranks skip, a layer none "
        "uses) + check_for_nan_in_grad + LR schedule",
        in_backward=True, offload=True, find_unused=True, static_graph=False, dynamic=True,
        never=True, hook=False, nan_check=True, max_grad_norm=0.5, tol=None,
    ),
    "device": dict(
        about="optimizer_in_backward(AdamW) on the device (no offload) + no_sync accumulation "
        "+ static_graph (a layer no step uses; torch's side: find_unused_parameters) + LR "
        "schedule",
        in_backward=True, offload=False, find_unused=False, static_graph=True, dynamic=False,
        never=True, hook=False, nan_check=False, max_grad_norm=None, tol=None,
    ),
    "views": dict(
        about="gradient_as_bucket_view + no_sync accumulation + allreduce_hook (both sides) + "
        "torch.optim.AdamW stepped by the loop + LR schedule",
        in_backward=False, offload=False, find_unused=False, static_graph=False, dynamic=False,
        never=False, hook=True, nan_check=False, max_grad_norm=None, tol=0.0,
    ),
}  # fmt: skip
MIB = 1024 * 1024


class Net(nn.Module):
    """Residual MLP with LayerNorms; ``branch`` runs only while ``use_branch`` is set, ``never``
    (if present) never runs."""

    def __init__(self, dim: int, depth: int, never: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)
        )
        self.branch = nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim) if never else None
        self.out = nn.Linear(dim, OUT)
        self.use_branch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def uses_branch(cfg: dict, step: int, micro: int, rank: int) -> bool:
    """Dynamic configurations: every 5th step no rank runs the branch (globally unused), else
    each rank runs it in some steps. ``--unused-pattern any``: in some micro-batches, at some
    steps only in the no_sync one on every rank that runs it; ``synced``: in both or neither."""
    if not cfg["dynamic"]:
        return True
    k = step * ACCUM + micro if cfg["pattern"] == "any" else step
    return step % 5 != 4 and (k + rank) % 3 == 0


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs for both wrappers; targets from a fixed random teacher."""
    gen = torch.Generator().manual_seed(((step * ACCUM + micro) * world + rank) * 7 + 1)
    x = torch.randn(BATCH, IN, generator=gen)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(12345)) / IN**0.5
    return x, torch.sin(3 * x @ teacher)


def rss_bytes() -> int:
    """VmRSS of this process (Linux), after a garbage collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return kib * 1024


def build(cfg: dict, args: argparse.Namespace, steps: int):
    """(torch's DDP, its optimizer, leanddp's, the optimizer its loop steps, schedulers, note)."""
    torch.manual_seed(0)
    model = Net(args.dim, args.depth, cfg["never"])
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    kw = dict(
        bucket_cap_mb=args.bucket_cap_mb,
        find_unused_parameters=cfg["find_unused"],
        static_graph=cfg["static_graph"],
        gradient_as_bucket_view=True,
    )
    # torch's own static_graph=True crashes under no_sync() (pytorch/pytorch#143580): for a
    # static graph its reference runs find_unused_parameters=True, the same arithmetic
    ref_kw = dict(kw, static_graph=False, find_unused_parameters=kw["find_unused_parameters"]
                  or kw["static_graph"])  # fmt: skip
    ref = nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group(), **ref_kw
    )
    ref_opt = adamw(ref.parameters())
    extra, note = {}, "off"
    if cfg["in_backward"]:
        extra = dict(optimizer_in_backward=adamw, offload_to_cpu=cfg["offload"])
        if cfg["offload"]:
            extra.update(max_grad_norm=cfg["max_grad_norm"], offload_threads=1)
    group = dist.new_group()
    ours = None
    if cfg["nan_check"] and not args.no_nan_check:
        try:
            ours = leanddp.DistributedDataParallel(
                model, process_group=group, check_for_nan_in_grad=True, **kw, **extra
            )
            note = "on"
        except NotImplementedError as e:
            note = f"unavailable, ran without it (NotImplementedError: {str(e)[:120]})"
    elif cfg["nan_check"]:
        note = "off (--no-nan-check)"
    if ours is None:
        ours = leanddp.DistributedDataParallel(model, process_group=group, **kw, **extra)
    ours_opt = ours.optimizer if cfg["in_backward"] else adamw(ours.parameters())
    if cfg["hook"]:
        ref.register_comm_hook(ref.process_group, allreduce_hook)
        ours.register_comm_hook(group, allreduce_hook)
    warm = max(1, steps // 10)

    def lr_factor(s: int) -> float:  # linear warm-up, then linear decay to 10%
        return min((s + 1) / warm, max(0.1, 1 - s / steps))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in (ref_opt, ours_opt)]
    return ref, ref_opt, ours, ours_opt, scheds, note


def train_step(ddp, opt, cfg, step, rank, world, max_norm=None) -> tuple[float, float | None]:
    """One optimizer step of ACCUM micro-batches (all but the last under no_sync): the loss
    and, with ``max_norm``, the gradient norm clip_grad_norm_ clipped from."""
    total, norm = 0.0, None
    for micro in range(ACCUM):
        ddp.module.use_branch = uses_branch(cfg, step, micro, rank)
        x, y = batch(step, micro, rank, world)
        with ddp.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
            loss = nn.functional.mse_loss(ddp(x), y) / ACCUM
            loss.backward()
        total += loss.item()
    if max_norm:
        norm = float(torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), max_norm))
    opt.step()  # a no-op for ddp.optimizer with optimizer_in_backward, called as loops do
    opt.zero_grad()
    return total, norm


def compare(ref: nn.Module, ours: nn.Module) -> dict:
    """Largest per-tensor relative (and absolute) difference of ours from torch's."""
    worst = dict(max_rel=0.0, max_abs=0.0, worst="", bitwise=True)
    mine = dict(ours.named_parameters())
    for name, a in ref.named_parameters():
        b = mine[name].detach().double()
        a = a.detach().double()
        d = (a - b).abs().max().item()
        rel = d / max(a.abs().max().item(), 1e-12) if d == d else float("inf")  # NaN: inf
        worst["bitwise"] &= torch.equal(a, b)
        worst["max_abs"] = max(worst["max_abs"], d)
        if rel > worst["max_rel"]:
            worst.update(max_rel=rel, worst=name)
    return worst


def across_ranks(module: nn.Module) -> float:
    """Max |this rank's parameters - rank 0's|, over all ranks (0.0: identical)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    r0 = flat.clone()
    dist.broadcast(r0, 0)
    d = torch.tensor([(flat - r0).abs().max().item()])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return d.item()


STAT_KEYS = ("bucket_bytes", "grad_bytes", "optimizer_state_bytes", "host_master_bytes",
             "host_buffer_bytes", "num_buckets", "peak_bucket_bytes")  # fmt: skip


def checkpoint(ref, ours, step: int, world: int) -> dict:
    """Parity (the worst rank's), cross-rank equality, every rank's RSS and memory_stats()."""
    ours.synchronize()
    rss = rss_bytes()
    stats = {k: ours.memory_stats()[k] for k in STAT_KEYS}
    gathered = [None] * world
    dist.all_gather_object(gathered, (rss, stats, compare(ref, ours)))
    point = dict(step=step, **max((g[2] for g in gathered), key=lambda c: c["max_rel"]))
    point["bitwise"] = all(g[2]["bitwise"] for g in gathered)
    point["ranks_differ_ours"] = across_ranks(ours.module)
    point["ranks_differ_ref"] = across_ranks(ref.module)
    point["rss"] = [g[0] for g in gathered]
    point["memory_stats"] = [g[1] for g in gathered]
    return point


def worker(rank: int, world: int, port: int, name: str, args: argparse.Namespace, out: str):
    torch.set_num_threads(1)
    os.environ.update(LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    cfg = dict(CONFIGS[name], pattern=args.unused_pattern)
    cfg["tol"] = args.rel_tol if cfg["tol"] is None else cfg["tol"]
    ref, ref_opt, ours, ours_opt, scheds, note = build(cfg, args, args.steps)
    norms, norm_diffs, checkpoints, start = [], [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        loss_ref, norm = train_step(ref, ref_opt, cfg, step, rank, world, cfg["max_grad_norm"])
        loss_ours, _ = train_step(ours, ours_opt, cfg, step, rank, world)
        for s in scheds:
            s.step()
        if norm is not None:
            norms.append(norm)
        if step % args.checkpoint_every and step != args.steps:
            continue
        point = checkpoint(ref, ours, step, world)
        if norm is not None:  # leanddp's norm of this step (offload_to_cpu) vs clip_grad_norm_'s
            norm_diffs.append(abs(ours.offload_stats()["grad_norm"] - norm) / max(norm, 1e-12))
        point.update(loss_ref=loss_ref, loss_ours=loss_ours, seconds=time.perf_counter() - start)
        checkpoints.append(point)
        if rank == 0:
            print(f"[long_run] {name} step {step}/{args.steps}  max rel diff "
                  f"{point['max_rel']:.2e}  RSS {'/'.join(map(mib, point['rss']))} MiB  loss "
                  f"{loss_ref:.5f}/{loss_ours:.5f}  ({point['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    if rank == 0:
        result = dict(config=name, about=cfg["about"], nan_check=note, tolerance=cfg["tol"],
                      checkpoints=checkpoints, seconds=time.perf_counter() - start,
                      offload_stats=ours.offload_stats() if cfg["offload"] else None)  # fmt: skip
        if norms:
            clipped = sum(n > cfg["max_grad_norm"] for n in norms)
            result["grad_norm"] = dict(steps_clipped=clipped, max_rel_diff=max(norm_diffs))
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verdict(r: dict, args: argparse.Namespace) -> list[str]:
    """Why this configuration failed (empty: it passed)."""
    fails, first, last = [], r["checkpoints"][0], r["checkpoints"][-1]
    tol = r["tolerance"]
    for c in r["checkpoints"]:
        if (not c["bitwise"]) if tol == 0.0 else not c["max_rel"] <= tol:  # NaN fails too
            want = "bitwise equality" if tol == 0.0 else f"tolerance {tol:.0e}"
            fails.append(f"step {c['step']}: max rel diff {c['max_rel']:.3e} ({c['worst']}) "
                         f"breaks {want}")  # fmt: skip
            break
    for c in r["checkpoints"]:
        if c["ranks_differ_ours"] > 0:
            fails.append(f"step {c['step']}: leanddp's ranks hold different parameters "
                         f"(max diff {c['ranks_differ_ours']:.3e})")  # fmt: skip
            break
    r["rss_growth"] = [b - a for a, b in zip(first["rss"], last["rss"], strict=True)]
    for rank, g in enumerate(r["rss_growth"]):
        if not g <= args.max_rss_growth_mb * MIB:
            fails.append(f"rank {rank}: RSS grew {g / MIB:.1f} MiB from step {first['step']} to "
                         f"{last['step']} (limit {args.max_rss_growth_mb} MiB)")  # fmt: skip
    return fails


def mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def render(report: dict) -> str:
    env, lines = report["env"], []
    lines += [
        f"`{env['command']}`",
        "",
        f"{env['cpu']} ({env['cpus']} CPUs), python {env['python']}, torch {env['torch']}, "
        f"leanddp {env['leanddp']}; 2 gloo ranks, 1 thread each; {report['params']} parameters, "
        f"bucket_cap_mb={report['args']['bucket_cap_mb']}, {ACCUM} micro-batches per step, "
        f"--unused-pattern {report['args']['unused_pattern']}",
        "",
        "| config | check_for_nan_in_grad | steps | max rel diff (end) | max rel diff (any "
        "checkpoint) | tolerance | RSS MiB @first r0/r1 | RSS MiB @end r0/r1 | growth MiB r0/r1 "
        "| time s | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "checkpoints" not in r:
            lines.append(f"| {r['config']} | | | | | | | | | | FAILED: {r['error']} |")
            continue
        first, last = r["checkpoints"][0], r["checkpoints"][-1]
        worst = max(c["max_rel"] for c in r["checkpoints"])
        tol = "bitwise" if r["tolerance"] == 0.0 else f"{r['tolerance']:.0e}"
        end = "bitwise equal" if last["bitwise"] else f"{last['max_rel']:.2e}"
        lines.append(
            f"| {r['config']} | {r['nan_check'].split(' (')[0]} | {last['step']} | {end} | "
            f"{worst:.2e} | {tol} | {'/'.join(map(mib, first['rss']))} (step {first['step']}) | "
            f"{'/'.join(map(mib, last['rss']))} | {'/'.join(map(mib, r['rss_growth']))} | "
            f"{r['seconds']:.0f} | {'; '.join(r['failures']) or 'pass'} |"
        )
    lines += ["", f"Fails if RSS grows more than {report['args']['max_rss_growth_mb']} MiB on a "
              f"rank from the first checkpoint to the end, if leanddp's ranks hold different "
              f"parameters, or beyond the tolerance: {TOLERANCE_NOTE}."]  # fmt: skip
    for r in report["runs"]:
        if "checkpoints" not in r:
            continue
        lines += ["", f"### {r['config']}: {r['about']}", "",
                  f"check_for_nan_in_grad: {r['nan_check']}", ""]  # fmt: skip
        if r.get("grad_norm"):
            g = r["grad_norm"]
            lines += [f"max_grad_norm: {g['steps_clipped']} steps clipped; grad_norm vs "
                      f"clip_grad_norm_: max rel diff {g['max_rel_diff']:.2e}", ""]  # fmt: skip
        lines += [
            "| step | max rel diff | max abs diff | worst tensor | ranks equal | RSS MiB r0/r1 | "
            "bucket bytes | host bytes (state+masters+staging) | loss torch/leanddp |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in r["checkpoints"]:
            s = c["memory_stats"][0]
            host = s["host_master_bytes"] + s["host_buffer_bytes"]
            host += s["optimizer_state_bytes"] if r["offload_stats"] else 0
            lines.append(
                f"| {c['step']} | {c['max_rel']:.2e} | {c['max_abs']:.2e} | {c['worst'] or '-'} | "
                f"{'yes' if c['ranks_differ_ours'] == 0 else c['ranks_differ_ours']} | "
                f"{'/'.join(map(mib, c['rss']))} | {s['bucket_bytes']} | {host} | "
                f"{c['loss_ref']:.5f}/{c['loss_ours']:.5f} |"
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="default: 100")
    p.add_argument("--bucket-cap-mb", type=float, default=0.001, help="default: 0.001")
    p.add_argument("--dim", type=int, default=128, help="model width (default: 128)")
    p.add_argument("--depth", type=int, default=4, help="residual blocks (default: 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW lr (default: 1e-3)")
    p.add_argument(
        "--unused-pattern", choices=["any", "synced"], default="any",
        help="when the dynamic branch runs: any micro-batch (default), or all of a step or none",
    )  # fmt: skip
    p.add_argument("--rel-tol", type=float, default=REL_TOL, help=f"default: {REL_TOL:.0e}")
    p.add_argument("--no-nan-check", action="store_true", help="no check_for_nan_in_grad")
    p.add_argument(
        "--max-rss-growth-mb", type=float, default=8.0,
        help="default: 8 (1000 steps grew 0.5-3.3 MiB per rank; a leak of 9 KiB a step fails)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("leanddp-long-run"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1:
        parser().error("--steps and --checkpoint-every must be at least 1")
    torch.set_num_threads(1)  # what every rank runs with (environment() reports it)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(
        env=environment(
            "benchmarks/long_run.py " + " ".join(sys.argv[1:] if argv is None else argv)
        ),
        args={k: str(v) for k, v in vars(args).items()},
        params=sum(p.numel() for p in Net(args.dim, args.depth, True).parameters()),
        runs=[],
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(args.configs):
            print(f"[long_run] [{k + 1}/{len(args.configs)}] {name}: {CONFIGS[name]['about']}",
                  file=sys.stderr, flush=True)  # fmt: skip
            out = str(Path(tmp) / f"{name}.json")
            try:
                mp.spawn(worker, args=(2, free_port(), name, args, out), nprocs=2, join=True)
                run = json.loads(Path(out).read_text())
                run["failures"] = verdict(run, args)
            except Exception as e:  # a rank raised or died: a failure to report, not to hide
                print(f"[long_run] {name} failed:\n{e}", file=sys.stderr, flush=True)
                run = dict(config=name, error=str(e).strip().splitlines()[-1][:300])
                run["failures"] = [run["error"]]
            report["runs"].append(run)
    report["seconds"] = time.perf_counter() - start
    text = render(report)
    print(text)
    (args.out / "long_run.md").write_text(text + "\n")
    (args.out / "long_run.json").write_text(json.dumps(report, indent=2))
    failed = [r["config"] for r in report["runs"] if r["failures"]]
    print(f"[long_run] {len(report['runs'])} configs in {report['seconds']:.0f} s; wrote "
          f"{args.out / 'long_run.md'} and long_run.json; "
          f"{'FAILED: ' + ', '.join(failed) if failed else 'all passed'}",
          file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Long-run reliability check: leanddp against torch's DDP for 2000 steps, every feature on.

Each configuration runs in 2 fresh gloo processes, one thread each, under ``--deadline-s``
(ranks still running then print their threads' stacks, are killed, and the run fails). In every
process torch's DistributedDataParallel + torch.optim.AdamW and leanddp.DistributedDataParallel
train copies of one small model on their own process groups, on the same data, with tiny
buckets and, each step, a random number (1 to ``--max-accum``, seeded, the same on every rank)
of micro-batches, all but the last under no_sync(). Every ``--checkpoint-every`` steps and at the
end it records (a) the largest relative difference of leanddp's parameters from torch's (per
tensor, max|ours - torch| / max|torch|) and whether the ranks hold identical parameters, (b)
each rank's resident memory (VmRSS after gc.collect()) and memory_stats(), and (c) per rank, the
largest value since the previous checkpoint (sampled after every step) of memory_stats()'s
bucket bytes, peak bucket bytes, buckets in flight, recycled bytes, gradient bytes and host
bytes, of the events leanddp created, and of the Python and OS threads. Writes long_run.md and
long_run.json into ``--out`` and exits non-zero if parameters diverge beyond a configuration's
tolerance, ranks disagree, RSS grows more than ``--max-rss-growth-mb`` or any of (c) changes
from the first checkpoint whose window starts after ``--warmup-steps`` to the end.

    PYTHONPATH=python python benchmarks/long_run.py [--steps 2000] [--configs everything ...]

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
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from _long_run_report import FLAT_KEYS, mib, render, verdict
from _ranks import free_port, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import leanddp
from leanddp._extension import _C
from leanddp.bench._env import environment

IN, OUT, BATCH = 32, 16, 16
#: Most micro-batches a step may draw (``--max-accum``'s default).
MAX_ACCUM = 4
#: Tolerance of the configurations stepped by leanddp's fused AdamW kernels (device or host).
REL_TOL = 1e-5
TOLERANCE_NOTE = (
    "views: bitwise equal to torch (same reduction, same torch.optim.AdamW). Every other "
    "configuration steps with leanddp's fused AdamW kernels (on the device, on the host with "
    "offload_to_cpu, in per-rank pieces with shard_optimizer_state: AdamW is elementwise, so a "
    "piece is bitwise what a whole step computes), whose rounding differs from "
    "torch.optim.AdamW's in the last bits; with max_grad_norm the norm is also summed in "
    "another order than clip_grad_norm_'s (per shard, then one allreduce), which moves the "
    "clipping coefficient by a few ulps. Neither the strict NaN check nor waiting for the end "
    "of backward (find_unused_parameters) changes a number. The drift measured 4.6e-7 at step "
    "100 and at most 1.1e-6 by step 1000 (Run 1), so 1e-5 leaves a 9x margin, while one missed "
    "or extra step shows as 1e-3 or more (raise --rel-tol for much longer runs)"
)
#: Fields of a configuration, off unless it sets them: in_backward (optimizer_in_backward=
#: AdamW), offload, shard (shard_optimizer_state), find_unused, static_graph, dynamic (a branch
#: some steps/ranks skip), never (a layer no step uses), hook (allreduce_hook), nan_check (False,
#: True or "strict"), max_grad_norm, tol (0.0: bitwise equal to torch; None: --rel-tol).
FIELDS = dict(in_backward=False, offload=False, shard=False, find_unused=False,
              static_graph=False, dynamic=False, never=False, hook=False, nan_check=False,
              max_grad_norm=None, tol=None)  # fmt: skip
#: name -> (what the configuration turns on, its fields that differ from FIELDS)
CONFIGS = {
    "everything": (
        "optimizer_in_backward(AdamW) + offload_to_cpu + max_grad_norm + no_sync accumulation + "
        "find_unused_parameters (a branch some steps/ranks skip, a layer none uses) + "
        "check_for_nan_in_grad + LR schedule",
        dict(in_backward=True, offload=True, find_unused=True, dynamic=True, never=True,
             nan_check=True, max_grad_norm=0.5),
    ),
    "device": (
        "optimizer_in_backward(AdamW) on the device (no offload) + no_sync accumulation + "
        "static_graph (a layer no step uses; torch's side: find_unused_parameters) + LR schedule",
        dict(in_backward=True, static_graph=True, never=True),
    ),
    "views": (
        "gradient_as_bucket_view + no_sync accumulation + allreduce_hook (both sides) + "
        "torch.optim.AdamW stepped by the loop + LR schedule",
        dict(hook=True, tol=0.0),
    ),
    "unused": (
        "optimizer_in_backward(AdamW) on the device + find_unused_parameters (a branch some "
        "steps/ranks skip, a layer none uses: the steps wait for the end of backward) + no_sync "
        "accumulation + LR schedule",
        dict(in_backward=True, find_unused=True, dynamic=True, never=True),
    ),
    "nan-strict": (
        "optimizer_in_backward(AdamW) on the device + check_for_nan_in_grad='strict' (the steps "
        "wait for the end of backward's check) + no_sync accumulation + LR schedule",
        dict(in_backward=True, nan_check="strict"),
    ),
    "sharded-clip": (
        "optimizer_in_backward(AdamW) + shard_optimizer_state + max_grad_norm (the steps wait "
        "for the end of backward's norm) on the device + no_sync accumulation + LR schedule",
        dict(in_backward=True, shard=True, max_grad_norm=0.5),
    ),
    "sharded-clip-offload": (
        "optimizer_in_backward(AdamW) + shard_optimizer_state + offload_to_cpu + max_grad_norm "
        "+ no_sync accumulation + LR schedule",
        dict(in_backward=True, shard=True, offload=True, max_grad_norm=0.5),
    ),
}  # fmt: skip


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


def config(name: str, args: argparse.Namespace) -> dict:
    """Configuration ``name``'s fields, with its description, ``pattern`` and tolerance."""
    about, fields = CONFIGS[name]
    cfg = dict(FIELDS, **fields, about=about, pattern=args.unused_pattern)
    cfg["tol"] = args.rel_tol if cfg["tol"] is None else cfg["tol"]
    return cfg


def micro_batches(step: int, args: argparse.Namespace) -> int:
    """How many micro-batches step ``step`` runs: 1 to ``--max-accum``, drawn from ``--seed``
    and the step alone, so every rank (and both wrappers) draws the same."""
    return random.Random(args.seed * 1_000_003 + step).randint(1, args.max_accum)


def uses_branch(cfg: dict, step: int, micro: int, rank: int) -> bool:
    """Dynamic configurations: every 5th step no rank runs the branch (globally unused), else
    each rank runs it in some steps. ``--unused-pattern any``: in some micro-batches, at some
    steps only in no_sync ones on every rank that runs it; ``synced``: in all or none."""
    if not cfg["dynamic"]:
        return True
    k = step * MAX_ACCUM + micro if cfg["pattern"] == "any" else step
    return step % 5 != 4 and (k + rank) % 3 == 0


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs for both wrappers; targets from a fixed random teacher."""
    gen = torch.Generator().manual_seed(((step * MAX_ACCUM + micro) * world + rank) * 7 + 1)
    x = torch.randn(BATCH, IN, generator=gen)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(12345)) / IN**0.5
    return x, torch.sin(3 * x @ teacher)


def proc_status(field: str) -> int:
    """The number in ``field`` of /proc/self/status (Linux): ``VmRSS`` in kB, ``Threads``."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))


def rss_bytes() -> int:
    """VmRSS of this process, after a garbage collection."""
    gc.collect()
    return proc_status("VmRSS") * 1024


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
    extra: dict = {}
    if cfg["in_backward"]:
        extra = dict(optimizer_in_backward=adamw, offload_to_cpu=cfg["offload"])
        extra.update(dict(offload_threads=1) if cfg["offload"] else {})
        extra.update(dict(shard_optimizer_state=True) if cfg["shard"] else {})
        extra.update(dict(max_grad_norm=cfg["max_grad_norm"]) if cfg["max_grad_norm"] else {})
    group, note = dist.new_group(), "off"
    if cfg["nan_check"] and args.no_nan_check:
        note = "off (--no-nan-check)"
    elif cfg["nan_check"]:
        extra["check_for_nan_in_grad"] = cfg["nan_check"]
        note = "strict" if cfg["nan_check"] == "strict" else "on"
    _C._testing.set_host_ordering(args.host_ordering)  # read at construction only
    try:
        ours = leanddp.DistributedDataParallel(model, process_group=group, **kw, **extra)
    finally:
        _C._testing.set_host_ordering(False)
    ours_opt = ours.optimizer if cfg["in_backward"] else adamw(ours.parameters())
    if cfg["hook"]:
        ref.register_comm_hook(ref.process_group, allreduce_hook)
        ours.register_comm_hook(group, allreduce_hook)
    warm = max(1, steps // 10)

    def lr_factor(s: int) -> float:  # linear warm-up, then linear decay to 10%
        return min((s + 1) / warm, max(0.1, 1 - s / steps))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in (ref_opt, ours_opt)]
    return ref, ref_opt, ours, ours_opt, scheds, note


def train_step(ddp, opt, cfg, step, micros, rank, world, max_norm=None) -> tuple[float, float]:
    """One optimizer step of ``micros`` micro-batches (all but the last under no_sync): the
    loss and, with ``max_norm``, the gradient norm clip_grad_norm_ clipped from (else -1)."""
    total, norm = 0.0, -1.0
    for micro in range(micros):
        ddp.module.use_branch = uses_branch(cfg, step, micro, rank)
        x, y = batch(step, micro, rank, world)
        with ddp.no_sync() if micro < micros - 1 else contextlib.nullcontext():
            loss = nn.functional.mse_loss(ddp(x), y) / micros
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
             "host_buffer_bytes", "host_accumulation_bytes", "num_buckets", "peak_bucket_bytes",
             "max_buckets_in_flight", "recycled_bucket_bytes")  # fmt: skip


def probe(ours, cfg: dict) -> dict[str, int]:
    """This rank's FLAT_KEYS now: memory_stats()'s counts (``host_bytes``: masters, staging,
    host accumulation, and the optimizer state where offload_to_cpu keeps it), the events
    leanddp's Reducer and in-backward optimizer created so far, Python and OS threads."""
    s = ours.memory_stats()
    core = ours._optimizer_core  # (private: the events counter is not in memory_stats())
    host = s["host_master_bytes"] + s["host_buffer_bytes"] + s["host_accumulation_bytes"]
    values = {k: s[k] for k in FLAT_KEYS if k in s}
    values.update(
        host_bytes=host + (s["optimizer_state_bytes"] if cfg["offload"] else 0),
        events_created=int(ours.reducer.events_created())
        + (int(core.events_created()) if core is not None else 0),
        py_threads=threading.active_count(),
        os_threads=proc_status("Threads"),
    )
    return values


def checkpoint(ref, ours, step: int, world: int, window: dict) -> dict:
    """Parity (the worst rank's), cross-rank equality, every rank's RSS, memory_stats() and
    ``window`` (its FLAT_KEYS' largest values since the last checkpoint)."""
    ours.synchronize()
    rss = rss_bytes()
    stats = {k: ours.memory_stats()[k] for k in STAT_KEYS}
    gathered = [None] * world
    dist.all_gather_object(gathered, (rss, stats, compare(ref, ours), window))
    point = dict(step=step, **max((g[2] for g in gathered), key=lambda c: c["max_rel"]))
    point["bitwise"] = all(g[2]["bitwise"] for g in gathered)
    point["ranks_differ_ours"] = across_ranks(ours.module)
    point["ranks_differ_ref"] = across_ranks(ref.module)
    point["rss"] = [g[0] for g in gathered]
    point["memory_stats"] = [g[1] for g in gathered]
    point["flat"] = [g[3] for g in gathered]
    return point


def worker(rank: int, world: int, port: int, name: str, args: argparse.Namespace, out: str):
    """One rank of configuration ``name``: trains both wrappers, checkpoints, and (rank 0)
    writes the configuration's result to ``out``."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    cfg = config(name, args)
    ref, ref_opt, ours, ours_opt, scheds, note = build(cfg, args, args.steps)
    norm_diffs, clipped, checkpoints, window = [], 0, [], {}
    drawn: Counter = Counter()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        micros = micro_batches(step, args)
        drawn[micros] += 1
        loss_ref, norm = train_step(
            ref, ref_opt, cfg, step, micros, rank, world, cfg["max_grad_norm"]
        )
        loss_ours, _ = train_step(ours, ours_opt, cfg, step, micros, rank, world)
        for s in scheds:
            s.step()
        ours_norm = ours.offload_stats()["grad_norm"] if cfg["max_grad_norm"] else -1.0
        if norm >= 0 and ours_norm >= 0:  # leanddp's norm of this step vs clip_grad_norm_'s
            norm_diffs.append(abs(ours_norm - norm) / max(norm, 1e-12))
            clipped += norm > cfg["max_grad_norm"]
        for k, v in probe(ours, cfg).items():
            window[k] = max(window.get(k, v), v)
        if step % args.checkpoint_every and step != args.steps:
            continue
        point = checkpoint(ref, ours, step, world, window)
        window = {}
        point.update(loss_ref=loss_ref, loss_ours=loss_ours, seconds=time.perf_counter() - start)
        checkpoints.append(point)
        if rank == 0:
            f = point["flat"]
            print(f"[long_run] {name} step {step}/{args.steps}  max rel diff "
                  f"{point['max_rel']:.2e}  RSS {'/'.join(map(mib, point['rss']))} MiB  "
                  f"threads {f[0]['os_threads']}/{f[1]['os_threads']}  events "
                  f"{f[0]['events_created']}  loss {loss_ref:.5f}/{loss_ours:.5f}  "
                  f"({point['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    if rank == 0:
        result = dict(config=name, about=cfg["about"], nan_check=note, tolerance=cfg["tol"],
                      checkpoints=checkpoints, seconds=time.perf_counter() - start,
                      micro_batches={str(k): drawn[k] for k in sorted(drawn)},
                      offload_stats=ours.offload_stats() if cfg["offload"] else None)  # fmt: skip
        if norm_diffs:
            result["grad_norm"] = dict(steps_clipped=clipped, max_rel_diff=max(norm_diffs))
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    """The command line (see module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="default: 100")
    p.add_argument(
        "--warmup-steps", type=int, default=100,
        help="flatness is measured from the first checkpoint whose window (the steps since the "
        "previous one) starts after this step (default: 100)",
    )  # fmt: skip
    p.add_argument("--max-accum", type=int, default=MAX_ACCUM,
                   help=f"most micro-batches a step draws (default: {MAX_ACCUM})")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="of the micro-batch draws (default: 0)")
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
        "--host-ordering", action="store_true",
        help="build leanddp's wrapper under the host-ordering seam (CPU tensors ordered as on a "
        "GPU: side streams and pooled events), so that events_created counts",
    )  # fmt: skip
    p.add_argument(
        "--max-rss-growth-mb", type=float, default=8.0,
        help="default: 8 (1000 steps grew 0.5-3.3 MiB per rank; a leak of 9 KiB a step fails)",
    )  # fmt: skip
    p.add_argument(
        "--deadline-s", type=float, default=3600.0,
        help="seconds a configuration's ranks may run before they are dumped and killed "
        "(default: 3600)",
    )  # fmt: skip
    p.add_argument(
        "--start-method", choices=["spawn", "fork"], default="spawn",
        help="of the rank processes (default: spawn; fork starts faster on the CPU)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("leanddp-long-run"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs every configuration, writes the report, returns the exit status."""
    args = parser().parse_args(argv)
    if min(args.steps, args.checkpoint_every, args.max_accum, args.deadline_s) <= 0:
        parser().error("--steps, --checkpoint-every, --max-accum, --deadline-s must be positive")
    if args.max_accum > MAX_ACCUM:
        parser().error(f"--max-accum is at most {MAX_ACCUM} (the data's seeds assume it)")
    torch.set_num_threads(1)  # what every rank runs with (environment() reports it)
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(
        env=environment(
            "benchmarks/long_run.py " + " ".join(sys.argv[1:] if argv is None else argv)
        ),
        args={k: str(v) for k, v in vars(args).items()},
        params=sum(p.numel() for p in Net(args.dim, args.depth, True).parameters()),
        tolerance_note=TOLERANCE_NOTE,
        runs=[],
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(args.configs):
            print(f"[long_run] [{k + 1}/{len(args.configs)}] {name}: {CONFIGS[name][0]}",
                  file=sys.stderr, flush=True)  # fmt: skip
            out = str(Path(tmp) / f"{name}.json")
            try:
                run_ranks(2, worker, (2, free_port(), name, args, out), args.deadline_s,
                          f"long_run {name}", args.start_method)  # fmt: skip
                run = json.loads(Path(out).read_text())
                run["failures"] = verdict(run, args)
            except Exception as e:  # a rank raised, died or hung: a failure to report
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

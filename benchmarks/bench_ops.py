"""Benchmark leanddp's ops against torch's own, with achieved bandwidth against a plain copy.

    python benchmarks/bench_ops.py [--device cpu|cuda|all] [--rounds N] [--out DIR]

Cases (each anchor measured in the same run, contenders interleaved round by round, medians):
  flatten  GPT-2-small parameter list (124M parameters, 148 tensors), and 2000 tensors of 1-4K
           elements: flatten_into vs torch.cat (into a preallocated out, and allocating) and
           torch._utils._flatten_dense_tensors.
  unflatten the GPT-2 list back from a flat buffer: unflatten_from vs torch._foreach_copy_.
  layouts  24 channels_last conv weights (7M parameters): their gradient bucket views scaled in
           place by flatten_into (one linear pass per slice) vs flat.mul_; and separate
           channels_last tensors flattened in row-major order into a contiguous buffer (the
           strided path) vs torch._foreach_copy_ into views of it.
  adamw    one AdamW step over the GPT-2 list: adamw_step_ over the list and over flat buffers
           (the bucket layout) vs torch.optim.AdamW(fused=True) and (foreach=True).
  adamw8bit one step of torchao's 8-bit AdamW over the GPT-2 list: adam8bit_step_ vs torchao's
           AdamW8bit (torch.compile'd; both rows need torchao, else the case is left out), with
           torch.optim.AdamW(fused=True) on fp32 state as the anchor.
  copy     dst.copy_(src) of the GPT-2 size: the bandwidth every other number is compared with.
Bytes counted (GB/s; every row of a case with its count): flatten/unflatten/copy read + write
every element; AdamW 28 B per fp32 parameter (reads param, grad, exp_avg, exp_avg_sq; writes
param, exp_avg, exp_avg_sq); 8-bit AdamW 16 B (reads param, grad and two 1-byte codes, writes
param and the codes; scales not counted).
Prints progress, then a markdown table; writes bench_ops.json and bench_ops_<device>.png into
--out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._utils import _flatten_dense_tensors

from leanddp import ops
from leanddp.bench._env import environment

# GPT-2 small: token and position embeddings, then 12 blocks of (qkv, proj, 2 LayerNorms, MLP).
GPT2_BLOCK = [
    (768, 2304),
    (2304,),
    (768, 768),
    (768,),
    (768,),
    (768,),
    (768, 3072),
    (3072,),
    (3072, 768),
    (768,),
    (768,),
    (768,),
]
GPT2_SHAPES = [(50257, 768), (1024, 768)] + GPT2_BLOCK * 12 + [(768,), (768,)]
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
TARGETS = [  # (device, case, metric, threshold) from the project's targets
    ("cpu", "flatten gpt2", "x_anchor", 1.0),
    ("cpu", "flatten 2000 small", "x_anchor", 2.0),
    ("cpu", "adamw gpt2", "x_anchor", 1.2),
    ("cuda", "flatten gpt2", "of_copy", 0.85),
    ("cuda", "unflatten gpt2", "of_copy", 0.85),
    ("cuda", "scale views channels_last", "of_copy", 0.85),
    ("cuda", "adamw gpt2", "of_copy", 0.85),
    ("cuda", "adamw gpt2", "x_anchor", 1.0),
]
UNITS = {"x_anchor": "x anchor", "of_copy": "of copy bandwidth"}


def target_values(rows: list[dict]) -> list[tuple[str, str, str, float, float]]:
    """Each target that ran, with the best leanddp implementation's value:
    (device, case, metric, threshold, value)."""
    out = []
    for device, case, metric, threshold in TARGETS:
        ours = [
            r[metric]
            for r in rows
            if (r["device"], r["case"]) == (device, case) and r["impl"].startswith("leanddp")
        ]
        if ours:
            out.append((device, case, metric, threshold, max(ours)))
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Timer:
    """Times calls on one device: wall clock on CPU, CUDA events on a GPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def run_case(timer: Timer, contenders: dict[str, Callable], rounds: int) -> dict[str, float]:
    """Median seconds per contender; contenders alternate within every round (the warm-up
    calls compile what compiles: torchao's step)."""
    for fn in contenders.values():  # warm-up: allocations, first-touch, autotuning
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(timer(fn))
    return {name: statistics.median(t) for name, t in times.items()}


Case = tuple[str, str, int, dict[str, Callable]]  # name, anchor, bytes moved, contenders


def copy_case(n: int, device: str) -> Case:
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return "copy", "copy_", 8 * n, {"copy_": lambda: dst.copy_(src)}


def flatten_case(name: str, ts: list[torch.Tensor]) -> Case:
    total = sum(t.numel() for t in ts)
    out = torch.empty(total, device=ts[0].device)
    views = [t.view(-1) for t in ts]
    return (
        name,
        "torch.cat(out=)",
        8 * total,
        {
            "leanddp flatten_into": lambda: ops.flatten_into(ts, out),
            "torch.cat(out=)": lambda: torch.cat(views, out=out),
            "torch.cat": lambda: torch.cat(views),
            "_flatten_dense_tensors": lambda: _flatten_dense_tensors(ts),
        },
    )


# A ResNet-like stage's conv weights, kept channels_last.
CONV_SHAPES = [(256, 128, 3, 3)] * 24


def _channels_last(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last)


def views_case(device: str) -> Case:
    """The bucket-view case: gradients that are channels_last views of their bucket slices,
    scaled in place (the 1/world scaling at launch). Sign flips keep the values stable."""
    like = [_channels_last(s, "meta") for s in CONV_SHAPES]
    flat = torch.randn(sum(t.numel() for t in like), device=device)
    views, offset = [], 0
    for t in like:
        views.append(flat.as_strided(t.shape, t.stride(), offset))
        offset += t.numel()
    return (
        "scale views channels_last",
        "flat.mul_",
        8 * flat.numel(),
        {
            "leanddp flatten_into (views, scale)": lambda: ops.flatten_into(views, flat, -1.0),
            "flat.mul_": lambda: flat.mul_(-1.0),
        },
    )


def permuted_case(device: str) -> Case:
    """Separate channels_last tensors into a contiguous buffer in row-major order."""
    ts = [_channels_last(s, device) for s in CONV_SHAPES]
    out = torch.empty(sum(t.numel() for t in ts), device=device)
    pieces = out.split([t.numel() for t in ts])
    dst = [v.view(t.shape) for v, t in zip(pieces, ts, strict=True)]
    return (
        "flatten channels_last",
        "torch._foreach_copy_",
        8 * out.numel(),
        {
            "leanddp flatten_into": lambda: ops.flatten_into(ts, out),
            "torch._foreach_copy_": lambda: torch._foreach_copy_(dst, ts),
        },
    )


def unflatten_case(params: list[torch.Tensor]) -> Case:
    flat = torch.cat([p.view(-1) for p in params])
    targets = [torch.empty_like(p) for p in params]
    pieces = flat.split([p.numel() for p in params])
    views = [v.view(p.shape) for v, p in zip(pieces, params, strict=True)]
    return (
        "unflatten gpt2",
        "torch._foreach_copy_",
        8 * flat.numel(),
        {
            "leanddp unflatten_from": lambda: ops.unflatten_from(flat, targets),
            "torch._foreach_copy_": lambda: torch._foreach_copy_(targets, views),
        },
    )


def adamw_case(params: list[torch.Tensor]) -> Case:
    grads = [p.grad for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    flat = torch.cat([p.view(-1) for p in params])
    flat_g, flat_m, flat_v = torch.randn_like(flat), torch.zeros_like(flat), torch.zeros_like(flat)
    fused = torch.optim.AdamW(params, fused=True, **ADAMW)
    foreach = torch.optim.AdamW(params, foreach=True, **ADAMW)
    beta1, beta2 = ADAMW["betas"]
    hyper = dict(
        lr=ADAMW["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    step = [0]

    def ours(*lists):
        step[0] += 1
        ops.adamw_step_(*lists, step=step[0], **hyper)

    return (
        "adamw gpt2",
        "torch AdamW(fused=True)",
        28 * flat.numel(),
        {
            "leanddp adamw_step_ (list)": lambda: ours(params, grads, m, v),
            "leanddp adamw_step_ (flat)": lambda: ours(flat, flat_g, flat_m, flat_v),
            "torch AdamW(fused=True)": fused.step,
            "torch AdamW(foreach=True)": foreach.step,
        },
    )


def adamw8bit_case(params: list[torch.Tensor]) -> Case | None:
    """8-bit AdamW: leanddp's kernel and torchao's step, each with its own parameters and state;
    None without torchao."""
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        log("    adamw8bit: torchao is not installed (pip install leanddp[lowbit]): left out")
        return None
    device = params[0].device
    grads = [p.grad for p in params]
    ours = [p.detach().clone() for p in params]
    state: list[list[torch.Tensor]] = [[], [], [], []]  # exp_avg, exp_avg_sq, their scales
    for p in ours:  # torchao's rule: 8-bit from 4096 elements, in blocks of 256
        quantized = p.numel() >= 4096 and p.numel() % 256 == 0
        for k in range(2):
            state[k].append(torch.zeros_like(p, dtype=torch.uint8 if quantized else p.dtype))
            state[k + 2].append(torch.zeros(p.numel() // 256 if quantized else 0, device=device))
    qs = OptimState8bit.zeros((256,), True, 256, device).qmap
    qu = OptimState8bit.zeros((256,), False, 256, device).qmap
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(theirs, grads, strict=True):
        p.grad = g
    torchao_opt = AdamW8bit(theirs, **ADAMW)
    fused = torch.optim.AdamW(params, fused=True, **ADAMW)
    beta1, beta2 = ADAMW["betas"]
    hyper = dict(lr=ADAMW["lr"], beta1=beta1, beta2=beta2, eps=ADAMW["eps"])
    step = [0]

    def run_ours() -> None:
        step[0] += 1
        ops.adam8bit_step_(
            ours, grads, *state, qs, qu, step=step[0], weight_decay=ADAMW["weight_decay"], **hyper
        )

    return (
        "adamw8bit gpt2",
        "torch AdamW(fused=True)",
        16 * sum(p.numel() for p in params),
        {
            "leanddp adam8bit_step_ (list)": run_ours,
            "torchao AdamW8bit": torchao_opt.step,
            "torch AdamW(fused=True)": fused.step,
        },
    )


def bench_device(device: str, rounds: int) -> list[dict]:
    """Every case on one device; rows carry GB/s, ratio to the anchor and share of copy GB/s."""
    log(f"[{device}] allocating GPT-2-small parameters and gradients")
    params = [torch.randn(s, device=device) for s in GPT2_SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    small = [torch.randn(int(k), device=device) for k in torch.randint(1024, 4097, (2000,))]
    n = sum(p.numel() for p in params)
    builders = [
        lambda: copy_case(n, device),
        lambda: flatten_case("flatten gpt2", params),
        lambda: flatten_case("flatten 2000 small", small),
        lambda: unflatten_case(params),
        lambda: views_case(device),
        lambda: permuted_case(device),
        lambda: adamw_case(params),
        lambda: adamw8bit_case(params),
    ]
    timer, rows = Timer(device), []
    for i, build in enumerate(builders, 1):
        case = build()
        if case is None:
            continue
        name, anchor, nbytes, contenders = case
        log(
            f"[{device} {i}/{len(builders)}] {name}: {len(contenders)} implementations, "
            f"{rounds} rounds"
        )
        medians = run_case(timer, contenders, rounds)
        del contenders  # frees this case's buffers before the next one allocates
        for impl, sec in medians.items():
            rows.append(
                dict(
                    device=device,
                    case=name,
                    impl=impl,
                    anchor=anchor,
                    ms=sec * 1e3,
                    gbps=nbytes / sec / 1e9,
                    x_anchor=medians[anchor] / sec,
                )
            )
        log("    " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items()))
    copy_gbps = next(r["gbps"] for r in rows if r["case"] == "copy")
    for row in rows:
        row["of_copy"] = row["gbps"] / copy_gbps
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        "",
        "| device | case | implementation | ms | GB/s | vs anchor | of copy GB/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        anchor = "anchor" if r["impl"] == r["anchor"] else f"{r['x_anchor']:.2f}x"
        lines.append(
            f"| {r['device']} | {r['case']} | {r['impl']} | {r['ms']:.2f} | "
            f"{r['gbps']:.1f} | {anchor} | {r['of_copy']:.0%} |"
        )
    lines += ["", "Targets (best leanddp implementation of each case):"]
    for device, case, metric, threshold, value in target_values(rows):
        verdict = "met" if value >= threshold else "MISSED"
        lines.append(
            f"- {device} {case}: {value:.2f} {UNITS[metric]} (target {threshold}) {verdict}"
        )
    adamw = [r for r in rows if r["case"] == "adamw gpt2" and r["impl"].startswith("leanddp")]
    for device in sorted({r["device"] for r in adamw}):
        best = max(r["of_copy"] for r in adamw if r["device"] == device)
        lines.append(
            f"- {device} adamw at 28 B/param: {best:.0%} of copy bandwidth"
            f"{' (target 60%)' if device == 'cpu' else ''}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], device: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return False
    rows = [r for r in rows if r["device"] == device]
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c != "copy"]
    copy_gbps = next(r["gbps"] for r in rows if r["case"] == "copy")
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.2 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases, strict=True):
        case_rows = [r for r in rows if r["case"] == case]
        colors = ["tab:green" if r["impl"].startswith("leanddp") else "tab:gray" for r in case_rows]
        ax.barh([r["impl"] for r in case_rows], [r["gbps"] for r in case_rows], color=colors)
        ax.axvline(copy_gbps, color="tab:red", linestyle="--", label=f"copy {copy_gbps:.0f} GB/s")
        ax.set_title(case, fontsize=10)
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("achieved GB/s (higher is better)")
    fig.suptitle(f"leanddp ops on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "all"],
        default="all",
        help="'all': cpu, and cuda when a GPU is visible",
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per case")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args(argv[1:])
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if not torch.cuda.is_available():
        if args.device == "cuda":
            raise SystemExit("--device cuda: no GPU is visible")
        devices = ["cpu"]
    env = environment("python " + " ".join(argv))
    rows = [row for device in devices for row in bench_device(device, args.rounds)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ops.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    for device in devices:
        png = args.out / f"bench_ops_{device}.png"
        if plot(rows, device, png):
            log(f"wrote {png}")
    print(markdown(rows, env))


if __name__ == "__main__":
    main(sys.argv)

"""Benchmark the host (CPU) optimizer step: leanddp's AdamW, fp32 and 8-bit, against others'.

    python benchmarks/bench_host_step.py [--numel N] [--layout flat|tensors] [--rounds N]
                                         [--threads N] [--json PATH] [--variants]

One AdamW step (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) over --numel float32
parameters on the CPU, either one flat tensor or a transformer-like list (an embedding, then
blocks of qkv/proj/MLP matrices, biases and LayerNorm vectors of width --dim). Implementations:
  torch AdamW(fused=True)   the anchor: .grad set once, opt.step() timed
  torch AdamW(foreach=True)
  leanddp adamw_step_       fp32 parameters, fp32 gradients
  leanddp adamw_step_ bf16  fp32 master parameters, bf16 gradients, and a bf16 copy of the
                            updated parameters written in the same pass (the offload_to_cpu case)
  torch fused + bf16 casts  the same job with torch: upcast the bf16 gradients into fp32 buffers,
                            fused step, downcast the parameters into the bf16 copy
  DeepSpeedCPUAdam          adamw_mode=True, when deepspeed imports and its cpu_adam op builds;
                            otherwise a row with the reason
  leanddp adam8bit_step_    torchao's block-wise 8-bit AdamW (blocks of 256; tensors under 4096
                            elements or not a multiple of 256 keep plain moments, as torchao's)
  torchao AdamW8bit         torchao's own step on the CPU (torch.compile per shape: the warm-up
                            compiles, minutes the first time); both rows need torchao
                            (pip install leanddp[lowbit]), otherwise they say why
  copy_ (fp32)              dst.copy_(src) of --numel floats: the bandwidth yardstick
Every implementation has its own tensors; they alternate round by round after two warm-up calls;
the table gives the median and minimum over --rounds.

GB/s is effective bandwidth: the least memory traffic the job needs (every input read once, every
output written once) divided by the median time; implementations that make extra passes move
more than they are credited with. Bytes per parameter:
  fp32 AdamW:              read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B)     = 28 B
  bf16 grads + bf16 copy:  read p, m, v (3 x 4 B) + g (2 B) + write p, m, v (3 x 4 B)
                           + copy (2 B)                                            = 28 B
  8-bit AdamW:             read p, g (2 x 4 B) + codes (2 x 1 B) + write p (4 B) + codes
                           (2 x 1 B), scales (8 B per 256 parameters) not counted  = 16 B
  copy_:                   read 4 B + write 4 B                                    =  8 B
Writes also cost a read-for-ownership unless stored non-temporally, so "of copy" can exceed 100%.
"vs anchor" is the anchor's median time over the row's (above 1 is faster).
--variants adds a table of the other kernel variants, each against torch's fused kernel on the
same data (torch._fused_adam_/_fused_adamw_/_fused_sgd_), the pair alternating round by round.
Progress goes to stderr, a markdown table to stdout, and with --json the rows and environment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_ops import log

from leanddp import ops
from leanddp.bench._env import environment

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
HYPER = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
ANCHOR, COPY, DEEPSPEED = "torch AdamW(fused=True)", "copy_ (fp32)", "DeepSpeedCPUAdam"

Step = Callable[[], object]
Contender = tuple[str, int, Step | None, str]  # name, bytes per element, step (None: skip), note


def shapes_for(numel: int, layout: str, dim: int) -> list[tuple[int, ...]]:
    """``numel`` elements as one tensor, or as GPT-style blocks plus an embedding for the rest."""
    if layout == "flat":
        return [(numel,)]
    block = [(dim, 3 * dim), (3 * dim,), (dim, dim), (dim,), (dim,), (dim,)]
    block += [(dim, 4 * dim), (4 * dim,), (4 * dim, dim), (dim,), (dim,), (dim,)]
    per_block = sum(math.prod(s) for s in block)
    blocks = max(1, numel * 3 // 4 // per_block)  # about a quarter goes to the embedding
    rest = numel - blocks * per_block
    if rest < 0:
        raise SystemExit(f"--numel {numel} is under one block of --dim {dim}: lower --dim")
    shapes: list[tuple[int, ...]] = [(rest // dim, dim)] if rest >= dim else []
    shapes += block * blocks
    return shapes + ([(rest % dim,)] if rest % dim else [])


def short(exc: BaseException) -> str:
    """One line naming an exception and its cause, short enough for a table cell."""
    parts = []
    cur: BaseException | None = exc
    while cur is not None and len(parts) < 3:
        first = (str(cur).strip().splitlines() or [""])[0]
        parts.append(f"{type(cur).__name__}: {first}"[:200])
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(parts).replace("|", "/")


def deepspeed_step(params: list[torch.Tensor]) -> tuple[Step | None, str]:
    """DeepSpeedCPUAdam's step over ``params`` (grads set), or None and why it is unavailable."""
    # deepspeed's logger binds sys.stdout when imported: send it to stderr to keep stdout a table.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as exc:
            return None, f"import deepspeed failed: {short(exc)}"
        log("building/loading DeepSpeed's cpu_adam op (the first JIT build takes minutes)")
        try:
            opt = DeepSpeedCPUAdam(
                params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True
            )
        except Exception as exc:
            return None, f"cpu_adam unavailable: {short(exc)}"
    return opt.step, ""


def lowbit_steps(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[Contender]:
    """leanddp's 8-bit AdamW kernel and torchao's AdamW8bit, each over its own copy of
    ``params`` with ``grads``; rows without a step (and why) when torchao is missing."""
    names = ("leanddp adam8bit_step_", "torchao AdamW8bit")
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.subclass_8bit import OptimState8bit
    except Exception as exc:
        why = f"torchao unavailable (pip install leanddp[lowbit]): {short(exc)}"
        return [(name, 16, None, why) for name in names]
    qs = OptimState8bit.zeros((256,), True, 256, "cpu").qmap
    qu = OptimState8bit.zeros((256,), False, 256, "cpu").qmap
    ours = [p.clone() for p in params]
    state: list[list[torch.Tensor]] = [[], [], [], []]  # exp_avg, exp_avg_sq and their scales
    for p in ours:
        quantized = p.numel() >= 4096 and p.numel() % 256 == 0
        for k in range(2):
            state[k].append(torch.zeros_like(p, dtype=torch.uint8 if quantized else p.dtype))
            state[k + 2].append(torch.zeros(p.numel() // 256 if quantized else 0))
    counter = [0]

    def run_ours() -> None:
        counter[0] += 1
        ops.adam8bit_step_(ours, grads, *state, qs, qu, step=counter[0], **HYPER)

    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(theirs, grads, strict=True):
        p.grad = g
    opt = AdamW8bit(theirs, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    note = "compiled per shape (torch.compile)"
    return [(names[0], 16, run_ours, ""), (names[1], 16, opt.step, note)]


def contenders(shapes: list[tuple[int, ...]], deepspeed: bool) -> list[Contender]:
    """Every implementation with its own parameters, gradients and state."""
    numel = sum(math.prod(s) for s in shapes)
    base_p, base_g = torch.randn(numel), torch.randn(numel) * 1e-2

    def tensors(src: torch.Tensor, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        pieces = src.to(dtype).split([math.prod(s) for s in shapes])
        return [t.view(s).clone() for t, s in zip(pieces, shapes, strict=True)]

    def with_grads() -> list[torch.Tensor]:
        params = tensors(base_p)
        for p, g in zip(params, tensors(base_g), strict=True):
            p.grad = g
        return params

    def zeros(params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.zeros_like(p) for p in params]

    def leanddp_step(grads: list[torch.Tensor], copy: list[torch.Tensor] | None) -> Step:
        p = tensors(base_p)
        m, v, step = zeros(p), zeros(p), [0]

        def run() -> None:
            step[0] += 1
            ops.adamw_step_(p, grads, m, v, step=step[0], param_copy=copy, **HYPER)

        return run

    adamw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def torch_casting() -> Step:
        params, g16 = with_grads(), tensors(base_g, torch.bfloat16)
        copy, opt = tensors(base_p, torch.bfloat16), torch.optim.AdamW(params, fused=True, **adamw)

        def run() -> None:
            torch._foreach_copy_([p.grad for p in params], g16)
            opt.step()
            torch._foreach_copy_(copy, params)

        return run

    rows: list[Contender] = [
        (ANCHOR, 28, torch.optim.AdamW(with_grads(), fused=True, **adamw).step, ""),
        (
            "torch AdamW(foreach=True)",
            28,
            torch.optim.AdamW(with_grads(), foreach=True, **adamw).step,
            "",
        ),
        ("leanddp adamw_step_", 28, leanddp_step(tensors(base_g), None), ""),
    ]
    bf16 = tensors(base_g, torch.bfloat16), tensors(base_p, torch.bfloat16)
    rows.append(("leanddp adamw_step_ bf16 grad+copy", 28, leanddp_step(*bf16), ""))
    rows.append(("torch fused + bf16 casts", 28, torch_casting(), "upcast g, step, downcast p"))
    if deepspeed:
        step, why = deepspeed_step(with_grads())
        rows.append((DEEPSPEED, 28, step, why))
    else:
        rows.append((DEEPSPEED, 28, None, "skipped (--no-deepspeed)"))
    rows += lowbit_steps(tensors(base_p), tensors(base_g))
    src, dst = base_p.clone(), torch.empty_like(base_p)
    rows.append((COPY, 8, lambda: dst.copy_(src), ""))
    return rows


def variant_pairs(shapes: list[tuple[int, ...]]) -> list[tuple[str, Step, Step]]:
    """(variant, leanddp's step, torch's fused step) over the same data, each with its own
    tensors: Adam's L2 form, bf16 and fp16 parameters (and state), a tensor lr with GradScaler's
    scale and found_inf (scale 1, nothing found: every step runs; torch writes the unscaled
    gradients back, an extra pass leanddp does not make), and SGD with and without momentum."""
    sizes = [math.prod(s) for s in shapes]

    def lists(dtype: torch.dtype, scale: float = 1.0, count: int = 4) -> list[list[torch.Tensor]]:
        return [
            [(torch.randn(n) * scale).to(dtype) if k < 2 else torch.zeros(n, dtype=dtype)
             for n in sizes]
            for k in range(count)
        ]  # fmt: skip

    def adam_pair(dtype: torch.dtype, decoupled: bool, scalars: bool) -> tuple[Step, Step]:
        ours, ref = lists(dtype), lists(dtype)
        steps = [torch.zeros(()) for _ in sizes]
        extra = {}
        if scalars:
            extra = dict(amp_scale=torch.ones(()), found_inf=torch.zeros(()))
        lr = torch.tensor(LR) if scalars else LR
        counter = [0]
        ours_op = ops.adamw_step_ if decoupled else ops.adam_step_
        ref_op = torch._fused_adamw_ if decoupled else torch._fused_adam_
        hyper = {**HYPER, "lr": lr}

        def run_ours() -> None:
            counter[0] += 1
            ours_op(*ours, step=counter[0], **hyper, **extra)

        def run_ref() -> None:
            torch._foreach_add_(steps, 1)
            ref_op(
                *ref, [], steps, amsgrad=False, maximize=False, **hyper,
                grad_scale=extra.get("amp_scale"), found_inf=extra.get("found_inf"),
            )  # fmt: skip

        return run_ours, run_ref

    def sgd_pair(momentum: float, dtype: torch.dtype = torch.float32) -> tuple[Step, Step]:
        ours, ref = lists(dtype, count=3), lists(dtype, count=3)
        first = [True, True]
        sgd = dict(lr=LR, momentum=momentum, dampening=0.0, nesterov=False, weight_decay=WD)

        def run_ours() -> None:
            ops.sgd_step_(*ours[:2], ours[2] if momentum else None, first_step=first[0], **sgd)
            first[0] = False

        def run_ref() -> None:
            torch._fused_sgd_(
                *ref[:2], ref[2] if momentum else [], maximize=False, is_first_step=first[1],
                **sgd,
            )  # fmt: skip
            first[1] = False

        return run_ours, run_ref

    pairs = [
        ("Adam (L2 weight decay), fp32", *adam_pair(torch.float32, False, False)),
        ("AdamW, bf16 parameters and state", *adam_pair(torch.bfloat16, True, False)),
        ("AdamW, fp16 parameters and state", *adam_pair(torch.float16, True, False)),
        ("AdamW, fp32, tensor lr + amp scale + found_inf", *adam_pair(torch.float32, True, True)),
        ("SGD momentum 0.9, fp32", *sgd_pair(0.9)),
        ("SGD without momentum, fp32", *sgd_pair(0.0)),
        ("SGD momentum 0.9, bf16 parameters and state", *sgd_pair(0.9, torch.bfloat16)),
        ("SGD momentum 0.9, fp16 parameters and state", *sgd_pair(0.9, torch.float16)),
    ]
    return pairs


def variants_markdown(pairs: list[tuple[str, Step, Step]], rounds: int) -> str:
    """Each variant's pair timed alternately; a table of medians and ratios."""
    lines = [
        "| variant | leanddp (ms) | torch fused (ms) | vs torch fused |",
        "|---|---:|---:|---:|",
    ]
    for name, ours, ref in pairs:
        log(f"variant: {name}")
        times = measure([("leanddp", 0, ours, ""), ("torch", 0, ref, "")], rounds)
        a, b = (statistics.median(times[k]) for k in ("leanddp", "torch"))
        lines.append(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f}x |")
    return "\n".join(lines)


def measure(rows: list[Contender], rounds: int) -> dict[str, list[float]]:
    """Seconds per round for every runnable contender; contenders alternate within a round."""
    runnable = [(name, fn) for name, _, fn, _ in rows if fn is not None]
    for name, fn in runnable:  # warm-up: first touch, lazy state, thread pools
        log(f"  warm-up {name}")
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name, _ in runnable}
    for i in range(rounds):
        for name, fn in runnable:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        log(f"  round {i + 1}/{rounds}: " + ", ".join(f"{t[-1] * 1e3:.1f}" for t in times.values()))
    return times


def summarize(rows: list[Contender], times: dict[str, list[float]], numel: int) -> list[dict]:
    """Per row: median/min ms, parameters/s, effective GB/s, ratio to the anchor, share of copy."""
    med = {name: statistics.median(t) for name, t in times.items()}
    copy_gbps = 8 * numel / med[COPY] / 1e9
    out = []
    for name, nbytes, _, note in rows:
        row: dict = dict(impl=name, bytes_per_param=nbytes, note=note, available=name in med)
        if name in med:
            sec = med[name]
            row.update(
                ms=sec * 1e3,
                ms_min=min(times[name]) * 1e3,
                params_per_s=numel / sec,
                gbps=nbytes * numel / sec / 1e9,
                x_anchor=med[ANCHOR] / sec,
            )
            row["of_copy"] = row["gbps"] / copy_gbps
        out.append(row)
    ours, theirs = (med.get(k) for k in ("leanddp adam8bit_step_", "torchao AdamW8bit"))
    if ours and theirs:  # the 8-bit kernel against torchao's step, in the same rounds
        for row in out:
            if row["impl"] == "leanddp adam8bit_step_":
                row["x_torchao"] = theirs / ours
                row["note"] = f"{theirs / ours:.1f}x torchao's step"
    return out


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        "",
        "| implementation | B/param | ms (median) | ms (min) | Mparam/s | GB/s | vs anchor "
        "| of copy GB/s | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if not r["available"]:
            cells = [r["impl"], str(r["bytes_per_param"])] + ["-"] * 6 + [r["note"]]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        ratio = "anchor" if r["impl"] == ANCHOR else f"{r['x_anchor']:.2f}x"
        lines.append(
            f"| {r['impl']} | {r['bytes_per_param']} | {r['ms']:.2f} | {r['ms_min']:.2f} | "
            f"{r['params_per_s'] / 1e6:.0f} | {r['gbps']:.1f} | {ratio} | {r['of_copy']:.0%} "
            f"| {r['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="parameters (16M)")
    parser.add_argument("--layout", choices=["flat", "tensors"], default="tensors")
    parser.add_argument("--dim", type=int, default=768, help="model width for --layout tensors")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--json", type=Path, help="write the rows and environment here")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="then every other kernel variant against torch's fused step on the same data",
    )
    args = parser.parse_args(argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = shapes_for(args.numel, args.layout, args.dim)
    numel = sum(math.prod(s) for s in shapes)
    log(f"allocating {len(shapes)} tensors, {numel / 1e6:.1f}M parameters per implementation")
    rows = contenders(shapes, deepspeed=not args.no_deepspeed)
    log(f"timing {sum(fn is not None for _, _, fn, _ in rows)} implementations")
    results = summarize(rows, measure(rows, args.rounds), numel)
    env = environment("python " + " ".join(argv))
    env.update(cores=os.cpu_count(), layout=f"{args.layout}, {len(shapes)} tensors")
    env.update(numel=numel, rounds=args.rounds)
    try:
        env["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        env["deepspeed"] = "not installed"
    if args.json:
        args.json.write_text(json.dumps(dict(env=env, rows=results), indent=1))
        log(f"wrote {args.json}")
    print(markdown(results, env))
    if args.variants:
        print()
        print(variants_markdown(variant_pairs(shapes), args.rounds))


if __name__ == "__main__":
    main(sys.argv)

"""A plain torchrun training loop with leanddp: PyTorch's DDP tutorial loop, a GPT-style model
(no transformers needed), a flag per memory-saving mode, checkpoints and exact resume.

Copy it and replace the model and the data. Run on CPU (gloo) or on GPUs (NCCL, one per rank):

    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --steps 50
    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --in-backward --accum 4
    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --offload --shard --clip 1.0
    torchrun --nproc-per-node 8 examples/torchrun_gpt.py --size gpt2 --dtype bf16 --plan

``--plan`` prints the planner's table (``python -m leanddp.plan``: memory per rank of every
configuration, and whether it fits) before training. ``--checkpoint PATH`` saves the model,
optimizer, LR scheduler and step there at the end (and every ``--save-every`` steps);
``--resume`` continues from it, and the resumed run takes the same steps on the same data as a
run that never stopped. ``--torch-ddp`` trains with torch's own DDP instead, for comparison.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import leanddp
import leanddp.plan

SIZES = {  # vocab, width, layers, heads, sequence length
    "tiny": (2048, 128, 2, 4, 64),
    "small": (8192, 384, 6, 6, 256),
    "gpt2": (50257, 768, 12, 12, 1024),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GPT(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, tied output layer."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.tok(tokens) + self.pos.weight[:n]
        h = self.norm(self.blocks(h, mask=mask.to(h.dtype), is_causal=True))
        return h @ self.tok.weight.T


def batch(step: int, micro: int, rank: int, args: argparse.Namespace, device) -> torch.Tensor:
    """Random tokens for (step, micro-batch, rank): the same after a resume as without one."""
    vocab, _, _, _, seq = SIZES[args.size]
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro * 31 + rank)
    return torch.randint(0, vocab, (args.batch, seq + 1), generator=gen).to(device)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="parameters' dtype")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (no_sync)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5, help="steps of linear LR warmup")
    p.add_argument("--clip", type=float, default=None, help="clip the gradients' global norm")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--in-backward", action="store_true", help="optimizer_in_backward")
    p.add_argument("--offload", action="store_true", help="offload_to_cpu (implies in-backward)")
    p.add_argument("--shard", action="store_true", help="shard_optimizer_state (in-backward)")
    p.add_argument("--torch-ddp", action="store_true", help="torch's DDP instead, to compare")
    p.add_argument("--checkpoint", type=Path, default=None, help="save here (and resume from)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--plan", action="store_true", help="print the memory plan first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()
    args.in_backward = args.in_backward or args.offload or args.shard
    if args.torch_ddp and args.in_backward:
        p.error("--torch-ddp trains with torch's DDP: leave out --in-backward/--offload/--shard")
    if args.resume and args.checkpoint is None:
        p.error("--resume needs --checkpoint PATH")
    for name in ("steps", "batch", "accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def wrap(model: nn.Module, args: argparse.Namespace, device: torch.device):
    """The DDP wrapper and the optimizer to step (None: backward steps it)."""
    ids = [device.index] if device.type == "cuda" else None
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    if args.torch_ddp:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return ddp, adamw(ddp.parameters())
    if not args.in_backward:
        ddp = leanddp.DistributedDataParallel(
            model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb
        )
        return ddp, adamw(ddp.parameters())
    ddp = leanddp.DistributedDataParallel(
        model,
        device_ids=ids,
        bucket_cap_mb=args.bucket_cap_mb,
        optimizer_in_backward=adamw,  # loss.backward() steps each bucket as it is reduced
        offload_to_cpu=args.offload,
        shard_optimizer_state=args.shard,
        max_grad_norm=args.clip,  # exact: clip_grad_norm_ before the step
    )
    return ddp, ddp.optimizer  # step() makes the updates visible; zero_grad() does nothing


def save(path: Path, step: int, ddp, opt, scheduler) -> None:
    """Every rank calls it: a sharded optimizer's state_dict() gathers every rank's shards."""
    state = {
        "step": step,
        "model": ddp.module.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": scheduler.state_dict(),
    }
    if dist.get_rank() == 0:
        torch.save(state, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    dist.barrier()


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)  # every rank builds the same model (DDP broadcasts rank 0's)
    model = GPT(*SIZES[args.size]).to(device=device, dtype=DTYPES[args.dtype])
    if args.plan and rank == 0:
        # per rank: this GPU, and this machine's memory shared by its ranks (on the CPU the
        # device memory is the host's too)
        gpu = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        print(
            leanddp.plan.plan(
                model,
                world_size=world,
                accumulation=args.accum,
                bucket_cap_mb=args.bucket_cap_mb,
                clip=args.clip is not None,
                gpu_memory_gb=gpu,
                host_memory_gb=host / local_world,
                device="cuda" if cuda else "cpu",
            ),
            flush=True,
        )
    ddp, opt = wrap(model, args, device)
    warmup = max(1, args.warmup)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    start = 0
    if args.resume:
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start}", flush=True)
    tic = time.perf_counter()
    total = float("nan")  # the last step's loss (rank 0's micro-batches)
    for step in range(start, args.steps):
        total = 0.0
        for micro in range(args.accum):
            last = micro == args.accum - 1
            with nullcontext() if last else ddp.no_sync():  # accumulate in place, no allreduce
                loss = loss_of(ddp, batch(step, micro, rank, args, device)) / args.accum
                loss.backward()
            total += loss.item()
        if args.clip is not None and not args.in_backward:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        if rank == 0 and (step + 1) % args.log_every == 0:
            ms = 1000 * (time.perf_counter() - tic) / (step + 1 - start)
            print(f"step {step + 1}/{args.steps}  loss {total:.5f}  {ms:.0f} ms/step", flush=True)
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0:
            save(args.checkpoint, step + 1, ddp, opt, scheduler)
    if args.checkpoint:
        save(args.checkpoint, args.steps, ddp, opt, scheduler)
    checksum = math.fsum(p.double().sum().item() for p in ddp.module.parameters())
    if rank == 0:
        print(f"final loss {total:.6f}  parameter checksum {checksum:.10e}", flush=True)
        if isinstance(ddp, leanddp.DistributedDataParallel):
            stats = ddp.memory_stats()
            print(
                f"memory: buckets {stats['bucket_bytes'] / 2**20:.2f} MiB (peak in backward "
                f"{stats['peak_bucket_bytes'] / 2**20:.2f}), optimizer state "
                f"{stats['optimizer_state_bytes'] / 2**20:.2f} MiB",
                flush=True,
            )
    del ddp, opt, scheduler
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain torchrun training loop with leanddp: PyTorch's DDP tutorial loop, a GPT-style model
(no transformers needed), a flag per memory-saving mode, checkpoints and exact resume.

Copy it and replace the model and the data. Run on CPU (gloo) or on GPUs (NCCL, one per rank):

    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --steps 50
    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --in-backward --accum 4
    torchrun --nproc-per-node 2 examples/torchrun_gpt.py --offload --shard --clip 1.0
    torchrun --nproc-per-node 8 examples/torchrun_gpt.py --size gpt2 --dtype bf16 --plan

``--plan`` prints the planner's table (``python -m leanddp.plan``: memory per rank of every
configuration, and whether it fits) before training. ``--checkpoint PATH`` saves the model,
optimizer, LR scheduler and step there at the end (and every ``--save-every`` steps), and a run
whose checkpoint exists continues from it: the same command line resumes after a crash, also
under ``torchrun --max-restarts N``, and the resumed run takes the same steps on the same data
as a run that never stopped, bit for bit. A save never leaves a broken checkpoint behind: a rank
killed while saving leaves the previous one to resume from. ``--checkpoint-format dcp`` saves
through ``torch.distributed.checkpoint`` instead of one gathered file: every rank writes its own
part (with ``--shard``, only its shard of the optimizer state). ``--torch-ddp`` trains with
torch's own DDP instead, for comparison.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
    p.add_argument("--checkpoint", type=Path, default=None, help="save here; resume if it exists")
    p.add_argument(
        "--checkpoint-format", choices=["file", "dcp"], default="file",
        help="file: one file, gathered on rank 0; dcp: a folder, torch.distributed.checkpoint",
    )  # fmt: skip
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--resume", action="store_true", help="fail unless --checkpoint exists")
    p.add_argument("--loss-log", type=Path, default=None, help="append each step's loss here")
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


def sync_to_disk(path: Path) -> None:
    """Flushes a written file (or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(args: argparse.Namespace, step: int, ddp, opt, scheduler) -> None:
    """Every rank calls it. A checkpoint appears whole or not at all: the new one is written
    beside the last, and a rename (atomic) makes it the one a restart finds."""
    path = args.checkpoint
    if args.checkpoint_format == "file":
        state = {
            "step": step,
            "model": ddp.module.state_dict(),
            "optimizer": opt.state_dict(),  # a sharded optimizer gathers every rank's shards
            "scheduler": scheduler.state_dict(),
        }
        if dist.get_rank() == 0:
            part = path.with_name(path.name + ".part")
            torch.save(state, part)
            sync_to_disk(part)
            part.replace(path)
            sync_to_disk(path.parent)
        dist.barrier()
        return
    # dcp: a folder per save under `path`, and `path/latest` naming the last complete one. dcp
    # writes the tensors, every rank its part; the rest (step, scheduler, a replicated
    # optimizer's param groups) goes beside them in one small file.
    sharded = sharded_optimizer(args, ddp)
    optimizer = opt.state_dict() if sharded is None else {}
    tensors = {
        "model": ddp.module.state_dict(),
        "optimizer": sharded if sharded is not None else {"state": optimizer["state"]},
    }
    rest = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "param_groups": optimizer.get("param_groups"),
    }
    name = f"step-{step:08d}"
    if dist.get_rank() == 0:  # what a crash while saving this step before left there
        shutil.rmtree(path / name, ignore_errors=True)
    dist.barrier()
    dcp.save(tensors, checkpoint_id=path / name)  # collective: returns once every part is written
    if dist.get_rank() == 0:
        torch.save(rest, path / name / "rest.pt")
        for written in (path / name / "rest.pt", path / name):
            sync_to_disk(written)
        (path / "latest.part").write_text(name)
        sync_to_disk(path / "latest.part")
        (path / "latest.part").replace(path / "latest")
        sync_to_disk(path)
        for old in path.glob("step-*"):  # earlier saves, and any a crash left unfinished
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def sharded_optimizer(args: argparse.Namespace, ddp) -> dict | None:
    """With --shard, this rank's shard of the optimizer state for dcp; else None."""
    return ddp.sharded_optimizer_state_dict() if args.shard else None


def saved(args: argparse.Namespace) -> Path | None:
    """The checkpoint to resume from, if one was saved."""
    path = args.checkpoint
    if path is None:
        return None
    if args.checkpoint_format == "file":
        return path if path.is_file() else None
    latest = path / "latest"
    return path / latest.read_text().strip() if latest.is_file() else None


def optimizer_template(folder: Path) -> dict:
    """A replicated optimizer's state tensors shaped as saved in a dcp folder, for dcp.load to
    fill: torch's optimizers hold no state before their first step to load into."""
    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, meta in metadata.items():
        parts = key.split(".")  # optimizer.state.<index>.<name>
        if parts[:2] == ["optimizer", "state"] and hasattr(meta, "size"):  # a tensor
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            state.setdefault(int(parts[2]), {})[parts[3]] = tensor
    return {"state": state}


def resume(args: argparse.Namespace, ddp, opt, scheduler, device: torch.device) -> int:
    """Loads the saved checkpoint into the model, optimizer and scheduler; its step."""
    found = saved(args)
    if found is None:
        return 0
    if args.checkpoint_format == "file":
        state = torch.load(found, map_location=device, weights_only=True)
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    else:
        sharded = sharded_optimizer(args, ddp)
        tensors = {
            "model": ddp.module.state_dict(),  # loaded in place
            "optimizer": sharded if sharded is not None else optimizer_template(found),
        }
        dcp.load(tensors, checkpoint_id=found)
        state = torch.load(found / "rest.pt", weights_only=True)
        if sharded is not None:
            ddp.load_sharded_optimizer_state_dict(tensors["optimizer"])
        else:
            opt.load_state_dict({**tensors["optimizer"], "param_groups": state["param_groups"]})
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal only if the parameters are, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


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
    if args.resume and saved(args) is None:
        raise SystemExit(f"--resume: no checkpoint at {args.checkpoint}")
    start = resume(args, ddp, opt, scheduler, device)
    if start and rank == 0:
        print(f"resumed from {saved(args)} at step {start}", flush=True)
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
        if rank == 0 and args.loss_log is not None:
            with args.loss_log.open("a") as log:
                log.write(f"{step + 1} {total.hex()}\n")
        if rank == 0 and (step + 1) % args.log_every == 0:
            ms = 1000 * (time.perf_counter() - tic) / (step + 1 - start)
            print(f"step {step + 1}/{args.steps}  loss {total:.5f}  {ms:.0f} ms/step", flush=True)
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0:
            save(args, step + 1, ddp, opt, scheduler)
    if args.checkpoint and start < args.steps:
        save(args, args.steps, ddp, opt, scheduler)
    checksum = math.fsum(p.double().sum().item() for p in ddp.module.parameters())
    if rank == 0:
        print(
            f"final loss {total:.6f}  parameter checksum {checksum:.10e}  "
            f"sha256 {digest(ddp.module)}",
            flush=True,
        )
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

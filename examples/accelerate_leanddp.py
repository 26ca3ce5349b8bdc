"""Gradient accumulation with Hugging Face Accelerate on ``leanddp.DistributedDataParallel``.

Accelerate wraps every trainable model in ``torch.nn.parallel.DistributedDataParallel`` inside
``Accelerator.prepare_model``. :class:`LeanDDPAccelerator` overrides that public method so the
wrapper is ``leanddp.DistributedDataParallel`` instead; the rest of Accelerate (``accumulate()``,
``no_sync()``, ``backward()``, ``clip_grad_norm_()``, ``unwrap_model()``, ``save_state()``) works
unchanged, because leanddp's wrapper is a subclass of torch's.

Run it on CPU with two processes (gloo), with either launcher (``--gpu``: one process per GPU,
NCCL)::

    torchrun --standalone --nproc_per_node=2 examples/accelerate_leanddp.py
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_leanddp.py

``--wrapper torch`` trains the same model with Accelerate's own torch DDP, for comparison;
``--out FILE`` saves the final (unwrapped) ``state_dict`` from rank 0;
``--optimizer-in-backward [--offload-to-cpu]`` lets leanddp step AdamW inside backward (with
the optimizer state on the host), the optimizer Accelerate prepares being ``model.optimizer``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend, set_seed
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import DataLoader, TensorDataset

import leanddp

MARKER = "ACCELERATE_LEANDDP_RESULT"
_DDP_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LeanDDPAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare()`` wraps models in ``leanddp.DistributedDataParallel``.

    Everything else is Accelerate's: device placement and autocast are applied by
    ``Accelerator.prepare_model`` as usual, then the model is wrapped by leanddp where Accelerate
    would have built torch's DDP (multi-process CPU or GPU runs), with the arguments of
    ``DistributedDataParallelKwargs`` (``kwargs_handlers``) plus ``leanddp_kwargs`` (for example
    ``optimizer_in_backward=...``). Single-process, FSDP and DeepSpeed runs are left to
    Accelerate unchanged.
    """

    def __init__(self, *args: Any, leanddp_kwargs: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.leanddp_kwargs: dict[str, Any] = dict(leanddp_kwargs or {})

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        """Prepares ``model`` like Accelerate does, with leanddp's wrapper instead of torch's."""
        if (
            evaluation_mode
            or getattr(model, "_is_accelerate_prepared", False)
            or self.distributed_type not in _DDP_TYPES
            or not self.use_distributed
            or not any(p.requires_grad for p in model.parameters())
        ):
            return super().prepare_model(model, device_placement, evaluation_mode)
        if self.parallelism_config is not None:
            raise NotImplementedError(
                "LeanDDPAccelerator: parallelism_config (tensor/context parallelism) is not "
                "supported; use Accelerator."
            )
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise NotImplementedError(
                "LeanDDPAccelerator: Accelerate's dynamo_backend (torch.compile) is not "
                "supported with leanddp.DistributedDataParallel."
            )
        # Device placement and mixed-precision autocast, but no DDP wrapper: that is what
        # Accelerate's evaluation_mode does.
        module = super().prepare_model(model, device_placement, evaluation_mode=True)
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        if self.distributed_type == DistributedType.MULTI_GPU:
            kwargs.setdefault("device_ids", [self.local_process_index])
            kwargs.setdefault("output_device", self.local_process_index)
        wrapped = leanddp.DistributedDataParallel(module, **kwargs, **self.leanddp_kwargs)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)
        # Accelerate's bookkeeping, as for its own DDP: the wrapper is marked prepared, while
        # the list save_state()/load_state() use keeps the unwrapped module, so checkpoints
        # have the same keys (no "module." prefix) as with torch's DDP.
        module.__dict__.pop("_is_accelerate_prepared", None)
        wrapped._is_accelerate_prepared = True
        return wrapped


def make_model() -> nn.Module:
    """A small MLP regression model."""
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 4),
    )


def make_data(seed: int, samples: int = 64) -> TensorDataset:
    """Random inputs and targets, the same on every rank (Accelerate shards them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=gen)
    y = torch.randn(samples, 4, generator=gen)
    return TensorDataset(x, y)


def allreduces_per_range(prof: profile, names: list[str]) -> list[int]:
    """How many allreduces the profiler saw start inside each ``record_function`` range."""
    events = prof.events()
    ranges = {e.name: e.time_range for e in events if e.name in names}
    starts = [e.time_range.start for e in events if e.name == "c10d::allreduce_"]
    counts = []
    for name in names:
        r = ranges[name]
        counts.append(sum(r.start <= t <= r.end for t in starts))
    return counts


def train(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """Trains with gradient accumulation under Accelerate; returns the report and whether this
    process is the main one."""
    set_seed(args.seed)
    accel_kwargs: dict[str, Any] = {"gradient_accumulation_steps": 2, "cpu": args.cpu}
    make_optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    in_backward = args.optimizer_in_backward
    if args.wrapper == "torch":
        accelerator = Accelerator(**accel_kwargs)
    else:
        leanddp_kwargs: dict[str, Any] = {}
        if in_backward:
            leanddp_kwargs["optimizer_in_backward"] = make_optimizer
        if args.offload_to_cpu:
            leanddp_kwargs["offload_to_cpu"] = True
            if args.max_grad_norm > 0:
                leanddp_kwargs["max_grad_norm"] = args.max_grad_norm  # exact, on the host
        accelerator = LeanDDPAccelerator(leanddp_kwargs=leanddp_kwargs, **accel_kwargs)
    model = make_model()
    loader = DataLoader(make_data(args.seed), batch_size=args.batch_size, shuffle=True)
    if in_backward:
        # The optimizer is built by the wrapper, so prepare the model first.
        model = accelerator.prepare(model)
        if not isinstance(model, leanddp.DistributedDataParallel):
            raise SystemExit("--optimizer-in-backward needs a multi-process launch (torchrun)")
        optimizer = model.optimizer
    else:
        optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    if in_backward:
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )

    micro_batches: list[dict[str, Any]] = []
    names: list[str] = []
    prof = profile(activities=[ProfilerActivity.CPU]) if args.count_allreduces else None
    if prof is not None:
        prof.start()
    for epoch in range(args.epochs):
        for i, (x, y) in enumerate(loader):
            name = f"micro_batch_{epoch}_{i}"
            names.append(name)
            with record_function(name), accelerator.accumulate(model):
                record: dict[str, Any] = {
                    "sync_gradients": accelerator.sync_gradients,
                    # False inside the wrapper's no_sync(), which accumulate() entered
                    "require_backward_grad_sync": bool(
                        getattr(model, "require_backward_grad_sync", True)
                    ),
                }
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)  # with optimizer_in_backward, this also steps
                if accelerator.sync_gradients and args.max_grad_norm > 0 and not in_backward:
                    norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    record["grad_norm"] = float(norm)
                optimizer.step()  # skipped by Accelerate on accumulation micro-batches
                scheduler.step()
                optimizer.zero_grad()
            if args.offload_to_cpu and args.max_grad_norm > 0 and record["sync_gradients"]:
                model.synchronize()  # for the report only: wait for the host step's norm
                record["grad_norm"] = model.offload_stats()["grad_norm"]
            record["loss"] = loss.item()
            micro_batches.append(record)
    if prof is not None:
        prof.stop()
        for record, count in zip(micro_batches, allreduces_per_range(prof, names), strict=True):
            record["allreduces"] = count

    unwrapped = accelerator.unwrap_model(model)
    result: dict[str, Any] = {
        "wrapper_type": f"{type(model).__module__}.{type(model).__qualname__}",
        "is_leanddp": isinstance(model, leanddp.DistributedDataParallel),
        "is_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
        "unwrapped_type": type(unwrapped).__name__,
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "micro_batches": micro_batches,
    }
    if args.check_state:
        result["state_roundtrip"] = check_state_roundtrip(
            accelerator, model, optimizer, args.check_state
        )
    if args.out and accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in unwrapped.state_dict().items()}, args.out)
    accelerator.wait_for_everyone()
    is_main = accelerator.is_main_process
    accelerator.end_training()
    return result, is_main


def check_state_roundtrip(
    accelerator: Accelerator, model: nn.Module, optimizer: Any, path: str
) -> bool:
    """``save_state(path)``, overwrite parameters and optimizer state, ``load_state(path)``:
    whether everything came back exactly. ``path`` must be visible to every process."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_before = copy.deepcopy(optimizer.state_dict())
    accelerator.save_state(path)
    accelerator.wait_for_everyone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v.zero_()
    accelerator.load_state(path)
    ok = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    opt_after = optimizer.state_dict()
    for pid, state in opt_before["state"].items():
        for key, value in state.items():
            other = opt_after["state"][pid][key]
            ok = ok and (torch.equal(value, other) if torch.is_tensor(value) else value == other)
    return ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["leanddp", "torch"], default="leanddp")
    parser.add_argument("--out", help="save the final unwrapped state_dict here (rank 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument(
        "--gpu", dest="cpu", action="store_false", help="use GPUs (NCCL) instead of CPU (gloo)"
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=0.3, help="global-norm clipping (0: none)"
    )
    parser.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="leanddp: step AdamW inside backward (optimizer_in_backward)",
    )
    parser.add_argument(
        "--offload-to-cpu",
        action="store_true",
        help="leanddp, with --optimizer-in-backward: optimizer state on the host (offload_to_cpu)",
    )
    parser.add_argument(
        "--count-allreduces",
        action="store_true",
        help="profile the loop and report the allreduces of every micro-batch",
    )
    parser.add_argument(
        "--check-state",
        metavar="DIR",
        help="check that accelerator.save_state(DIR)/load_state(DIR) restore model and optimizer",
    )
    args = parser.parse_args(argv)
    if args.wrapper == "torch" and (args.optimizer_in_backward or args.offload_to_cpu):
        parser.error("--optimizer-in-backward and --offload-to-cpu need --wrapper leanddp")
    if args.offload_to_cpu and not args.optimizer_in_backward:
        parser.error("--offload-to-cpu needs --optimizer-in-backward")
    if args.optimizer_in_backward and not args.offload_to_cpu and args.max_grad_norm > 0:
        parser.error(
            "--optimizer-in-backward clips exactly only with --offload-to-cpu; add it, or pass "
            "--max-grad-norm 0"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point: train, then print one JSON line from rank 0."""
    args = parse_args(argv)
    result, is_main = train(args)
    if is_main:
        print(MARKER, json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""leanddp with PyTorch Lightning: a DDP strategy that wraps the LightningModule with
``leanddp.DistributedDataParallel`` instead of torch's DDP, and a small training script.

Copy ``LeanDDPStrategy`` into your project and pass it to the Trainer::

    trainer = Trainer(accelerator="gpu", devices=8, strategy=LeanDDPStrategy())
    trainer = Trainer(..., strategy=LeanDDPStrategy(optimizer_in_backward=True))

Run the demo (2 CPU processes on gloo, gradient accumulation 2)::

    python examples/lightning_leanddp.py                          # leanddp
    python examples/lightning_leanddp.py --optimizer-in-backward  # steps inside backward
    python examples/lightning_leanddp.py --strategy ddp           # Lightning's stock DDP

See docs/lightning.md.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import leanddp


class LeanDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with ``leanddp.DistributedDataParallel`` as the wrapper.

    Every argument of ``DDPStrategy`` is accepted; the extra keyword arguments (torch's DDP
    arguments such as ``bucket_cap_mb`` or ``static_graph``, and leanddp's ``offload_to_cpu``,
    ``max_grad_norm`` and ``offload_threads``) go to ``leanddp.DistributedDataParallel``.

    ``optimizer_in_backward=True``: the single optimizer returned by the LightningModule's
    ``configure_optimizers`` is handed to leanddp, which steps it bucket by bucket inside
    backward; Lightning's ``optimizer.step()`` then only runs the training closure. LR schedulers
    and checkpoints work as usual. Not with ``gradient_clip_val`` (use ``offload_to_cpu=True,
    max_grad_norm=...``) nor with a GradScaler (``precision="16-mixed"``; use ``"bf16-mixed"``).
    """

    def __init__(self, *args: Any, optimizer_in_backward: bool = False, **kwargs: Any) -> None:
        if not isinstance(optimizer_in_backward, bool):
            raise TypeError(
                "LeanDDPStrategy: optimizer_in_backward is True or False; the optimizer comes "
                "from the LightningModule's configure_optimizers"
            )
        super().__init__(*args, **kwargs)
        self._optimizer_in_backward = optimizer_in_backward

    def _setup_model(self, model: nn.Module) -> leanddp.DistributedDataParallel:
        """Wraps the LightningModule with ``leanddp.DistributedDataParallel``."""
        kwargs = dict(self._ddp_kwargs)
        if self._optimizer_in_backward:
            trainer = model.trainer
            if trainer.gradient_clip_val:
                raise ValueError(
                    "LeanDDPStrategy(optimizer_in_backward=True): gradient_clip_val cannot clip "
                    "gradients that were stepped inside backward; pass "
                    "LeanDDPStrategy(optimizer_in_backward=True, offload_to_cpu=True, "
                    "max_grad_norm=...) for exact global-norm clipping"
                )
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError(
                    "LeanDDPStrategy(optimizer_in_backward=True): a GradScaler (precision="
                    "'16-mixed') must unscale gradients before the step, which happens inside "
                    "backward here; use precision='bf16-mixed' or '32-true'"
                )
            # leanddp takes over the optimizer: build it (and its schedulers) before wrapping.
            super().setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    "LeanDDPStrategy(optimizer_in_backward=True): configure_optimizers must "
                    f"return one optimizer, got {len(self.optimizers)}"
                )
            optimizer = self.optimizers[0]
            kwargs["optimizer_in_backward"] = lambda params: optimizer
        if kwargs.get("offload_to_cpu"):
            # leanddp shares the host-step threads among LOCAL_WORLD_SIZE processes (torchrun's).
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.num_processes))
        device_ids = self.determine_ddp_device_ids()
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:
            return leanddp.DistributedDataParallel(module=model, device_ids=device_ids, **kwargs)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Builds the optimizers, unless ``_setup_model`` already did (optimizer_in_backward)."""
        if not self._optimizer_in_backward:
            super().setup_optimizers(trainer)


# ------------------------------------------------------------------------------------------
# the demo: a small regression MLP on random data


class RegressionModel(pl.LightningModule):
    """A two-layer MLP trained with AdamW and a step LR schedule."""

    def __init__(self, width: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_train_start(self) -> None:
        wrapper = self.trainer.strategy.model
        in_backward = getattr(wrapper, "optimizer", None) is self.trainer.optimizers[0]
        name = f"{type(wrapper).__module__}.{type(wrapper).__name__}"
        print(
            f"rank {self.global_rank}: wrapped by {name}, optimizer_in_backward={in_backward}",
            flush=True,
        )


def make_dataset(samples: int = 128, seed: int = 0) -> TensorDataset:
    """Random regression data, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    """Trains the demo model on 2 CPU processes; see ``--help``."""
    parser = argparse.ArgumentParser(description="Trains a small model with LeanDDPStrategy.")
    parser.add_argument("--strategy", choices=["leanddp", "ddp"], default="leanddp")
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("--offload-to-cpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--resume", help="checkpoint to resume from")
    parser.add_argument("--save-checkpoint", help="write a checkpoint here after training")
    parser.add_argument("--out", help="rank 0 writes the final state_dict here (torch.save)")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    if args.strategy == "ddp":
        strategy: DDPStrategy = DDPStrategy(process_group_backend="gloo")
    else:
        leanddp_kwargs = {"offload_to_cpu": True} if args.offload_to_cpu else {}
        strategy = LeanDDPStrategy(
            process_group_backend="gloo",
            optimizer_in_backward=args.optimizer_in_backward,
            **leanddp_kwargs,
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = RegressionModel()
    # 128 samples, 2 ranks, micro-batches of 8: 8 micro-batches per rank and epoch
    loader = DataLoader(make_dataset(), batch_size=8, shuffle=True)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if args.save_checkpoint:
        trainer.save_checkpoint(args.save_checkpoint)  # every rank takes part; rank 0 writes
    if args.out and trainer.is_global_zero:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        state = {"state_dict": model.state_dict(), "global_step": trainer.global_step, "lr": lr}
        torch.save(state, args.out)
    loss = float(trainer.callback_metrics["train_loss"])
    print(
        f"rank {trainer.global_rank}: global_step={trainer.global_step} loss={loss:.4f}", flush=True
    )


if __name__ == "__main__":
    main()

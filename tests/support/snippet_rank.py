"""One rank of a documentation snippet, as torchrun would start it (CPU, gloo): the runner of
tests/docs/test_snippets.py forks two processes from its fork server that set torchrun's
environment variables and call :func:`main`.

The snippet finds the names a guide assumes already defined (``model``, ``loader``,
``local_rank``, ...; :func:`given`), and the process group initialised unless it initialises it
itself. Its GPU lines run on the CPU through the substitutions of :data:`ON_CPU`, the only
change made to it. A snippet that leaves a ``leanddp.DistributedDataParallel`` in ``model``
without training it then trains it one step, so that a wrapper built with every argument of the
snippet also runs.

By hand: ``torchrun --nproc-per-node 2 snippet_rank.py SNIPPET_FILE``
"""

from __future__ import annotations

import functools
import os
import sys
import types

import torch
import torch.distributed as dist
from torch import nn

import leanddp

#: (GPU text, what runs on the CPU instead), applied in order
ON_CPU = [
    ('"nccl"', '"gloo"'),
    (".cuda()", ""),
    ("torch.cuda.set_device(", "(lambda device: None)("),
    ("device_ids=[local_rank]", "device_ids=None"),
    ("device_ids=[rank]", "device_ids=None"),
    ('torch.amp.GradScaler("cuda")', 'torch.amp.GradScaler("cpu")'),
    ("LeanDDPAccelerator(", "LeanDDPAccelerator(cpu=True, "),  # (Accelerate's CPU processes)
    # Lightning: the two CPU processes already started, and a short run
    ('accelerator="gpu", devices=8,', 'accelerator="cpu", devices=2, max_steps=2, logger=False,'),
]


#: Lightning's snippet: the class that wrapped the model when training started
TRAINED: dict[str, type] = {}


class TinyModel(nn.Module):
    """Stands for the guides' ``model``: ``model(batch).loss`` as a Hugging Face model's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(
        self, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> types.SimpleNamespace:
        x, y = batch if isinstance(batch, (tuple, list)) else (batch, torch.zeros_like(batch))
        logits = self.body(x.to(self.body[0].weight.dtype))
        return types.SimpleNamespace(logits=logits, loss=(logits.float() - y).square().mean())


def given() -> dict[str, object]:
    """The names the guides' snippets take as defined by the surrounding script."""
    torch.manual_seed(0)
    model = TinyModel()
    loader = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return dict(
        torch=torch, nn=nn, dist=dist, functools=functools, os=os, leanddp=leanddp,
        model=model, loader=loader, optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        schedule=lambda step: 1.0,
        loss_fn=lambda out, y: (out.logits - y).square().mean(),
        rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
    )  # fmt: skip


def given_by_frameworks(source: str) -> dict[str, object]:
    """What the Lightning and Accelerate guides assume: their example's classes (examples/ is
    on the path), and for Lightning a LightningModule as ``model`` and a ``datamodule``."""
    names: dict[str, object] = {}
    if "LeanDDPAccelerator" in source:
        from accelerate_leanddp import LeanDDPAccelerator

        names["LeanDDPAccelerator"] = LeanDDPAccelerator
    if "LeanDDPStrategy" in source:
        import lightning.pytorch as pl
        from lightning_leanddp import LeanDDPStrategy, RegressionModel, make_dataset
        from torch.utils.data import DataLoader

        class Data(pl.LightningDataModule):
            def train_dataloader(self) -> DataLoader:
                return DataLoader(make_dataset(), batch_size=8)

        class Model(RegressionModel):
            def on_train_start(self) -> None:  # (the strategy unwraps it when done)
                TRAINED["wrapped_by"] = type(self.trainer.strategy.model)

        names.update(LeanDDPStrategy=LeanDDPStrategy, model=Model(), datamodule=Data())
    return names


def on_cpu(source: str) -> str:
    for gpu, cpu in ON_CPU:
        source = source.replace(gpu, cpu)
    return source


def main(path: str) -> None:
    with open(path) as f:
        source = on_cpu(f.read())
    names = given() | given_by_frameworks(source)
    frameworks = ("LeanDDPStrategy", "LeanDDPAccelerator")  # (they start the group themselves)
    if "init_process_group" not in source and not any(f in source for f in frameworks):
        dist.init_process_group("gloo")
    exec(compile(source, path, "exec"), names)  # noqa: S102 (the snippet under test)
    model = names.get("model")
    if "LeanDDPAccelerator" in source:  # (prepared: the model it returned is leanddp's)
        assert isinstance(model, leanddp.DistributedDataParallel), type(model)
    if "trainer" in names:  # (Lightning: what wrapped the model it trained)
        wrapped_by = TRAINED.get("wrapped_by")
        assert wrapped_by is leanddp.DistributedDataParallel, wrapped_by
    if isinstance(model, leanddp.DistributedDataParallel) and "backward" not in source:
        model(names["loader"][0]).loss.backward()
        model.synchronize()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

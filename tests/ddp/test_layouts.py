"""Parameters in dense non-contiguous layouts (a conv net in channels_last, a Linear whose weight
is a transposed matrix) under leanddp against torch's DDP in the same processes, on random data:
plain steps, no_sync() accumulation, zero_grad(set_to_none=False), gradient_as_bucket_view=False,
and optimizer_in_backward with AdamW and SGD momentum (stepped by the fused kernels, state laid
out like the parameters)."""

from __future__ import annotations

import torch
from ddp_models import Case, LockStep, assert_same
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep, assert_params_close
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from leanddp import _C

STEPS = 4
BATCH = 4


def _image_batch() -> torch.Tensor:
    return torch.randn(BATCH, 3, 6, 6).contiguous(memory_format=torch.channels_last)


class PermutedNet(nn.Module):
    """Two convolutions in channels_last, a Linear whose weight is stored transposed (strides
    (1, rows)) and a plain head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 6, 3, padding=1)
        self.to(memory_format=torch.channels_last)
        self.fc = nn.Linear(6, 10)
        self.fc.weight = nn.Parameter(self.fc.weight.detach().t().contiguous().t())
        self.head = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.head(torch.tanh(self.fc(x.mean((2, 3)))))


PERMUTED = ("c1.weight", "c2.weight", "fc.weight")


def _assert_layouts(module: nn.Module) -> None:
    """The wrapped copy kept every layout (the test would prove nothing otherwise)."""
    params = dict(module.named_parameters())
    for name in PERMUTED:
        p = params[name]
        spec = _C.state_spec(_C.OptimKind.adam, p, on_host=False, momentum=False)
        assert not p.is_contiguous() and spec.stepped, name  # (the device kernels step it)
    assert params["c1.weight"].is_contiguous(memory_format=torch.channels_last)
    assert params["fc.weight"].stride() == (1, 10)


def _assert_bucket_views(module: nn.Module, what: str) -> None:
    """Every gradient is a view of the one bucket's flat buffer with its parameter's strides."""
    storages = set()
    for name, p in module.named_parameters():
        assert p.grad.stride() == p.stride(), f"{what} {name}: {p.grad.stride()} != {p.stride()}"
        storages.add(p.grad.untyped_storage().data_ptr())
    assert len(storages) == 1, f"{what}: gradients in {len(storages)} storages, not one bucket"


def _plain_cases(rank: int, world_size: int) -> None:
    for views, accum, set_to_none in [
        (True, 1, True),
        (True, 2, True),
        (True, 1, False),
        (True, 3, False),
        (False, 2, True),
        (False, 1, False),
    ]:
        case = Case(views=views, accum=accum)
        what = f"views={views} accum={accum} set_to_none={set_to_none}"
        run = LockStep(PermutedNet(), case)
        _assert_layouts(run.ours.module)
        for step in range(STEPS):
            run.backward([_image_batch() for _ in range(accum)], set_to_none=set_to_none)
            for name, a, b in run.pairs():
                # Two ranks: torch's DDP and leanddp add and divide the same way, bitwise.
                assert_same(a.grad, b.grad, f"{what} step {step} grad of {name}", exact=True)
            if views:
                _assert_bucket_views(run.ours.module, f"{what} step {step}")
            else:
                for name, _, b in run.pairs():
                    assert b.grad.stride() == b.stride(), f"{what} {name}"
            run.step()
            for name, a, b in run.pairs():
                assert_same(a, b, f"{what} step {step} {name}", exact=True)
    _comm_hook_case()


def _recording_hook(seen: dict[str, torch.Tensor], names: dict[int, str]):
    """torch's allreduce hook, recording what GradBucket.gradients() shows for each parameter
    (torch's are row-major views of the slices, whatever the parameter's layout)."""

    def hook(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            seen[names[id(p)]] = g.clone()  # clone keeps a dense tensor's strides
        return default_hooks.allreduce_hook(None, bucket)

    return hook


def _comm_hook_case() -> None:
    """A comm hook sees the bucket torch's does: the same slices (each in its parameter's memory
    order), through the same gradients() views."""
    run = LockStep(PermutedNet(), Case())
    seen: list[dict[str, torch.Tensor]] = [{}, {}]
    for ddp, record in zip((run.ref, run.ours), seen, strict=True):
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        ddp.register_comm_hook(None, _recording_hook(record, names))
    for step in range(STEPS):
        run.backward([_image_batch()])
        assert sorted(seen[0]) == sorted(seen[1]) == sorted(n for n, _, _ in run.pairs())
        for name, a, b in run.pairs():
            assert seen[1][name].stride() == seen[0][name].stride(), name
            assert_same(seen[0][name], seen[1][name], f"hook step {step} {name}", exact=True)
            assert_same(a.grad, b.grad, f"hook step {step} grad of {name}", exact=True)
        run.step()


def test_permuted_layouts_match_torch_ddp() -> None:
    run_ranks(2, _plain_cases)


def _in_backward_cases(rank: int, world_size: int) -> None:
    for name, accum in [("adamw", 1), ("adamw", 2), ("sgd-nesterov", 1), ("sgd-groups", 2)]:
        what = f"{name} accum={accum}"
        run = InBackwardLockStep(PermutedNet(), OPTIMIZERS[name])
        _assert_layouts(run.ours.module)
        link = run.ours.optimizer.__dict__["_leanddp_link"]
        assert all(link.fused), f"{what}: some parameters go to the fallback"
        for step in range(STEPS):
            run.step([_image_batch() for _ in range(accum)])
            assert_params_close(run, f"{what} step {step}")
        # The fused state is torch's, laid out like each parameter, in one flat buffer per kind.
        ours = dict(run.ours.module.named_parameters())
        keys = ("exp_avg", "exp_avg_sq") if "adam" in name else ("momentum_buffer",)
        for key in keys:
            storages = set()
            for pname, ref_p in run.ref.module.named_parameters():
                mine = run.ours.optimizer.state[ours[pname]][key]
                theirs = run.ref_opt.state[ref_p][key]
                assert mine.stride() == ours[pname].stride(), f"{what} {pname} {key}"
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
                storages.add(mine.untyped_storage().data_ptr())
            assert len(storages) == 1, f"{what} {key}: not the fused flat state"


def test_permuted_layouts_in_backward_match_torch() -> None:
    run_ranks(2, _in_backward_cases)

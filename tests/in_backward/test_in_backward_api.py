"""optimizer_in_backward: what a user's loop meets. ddp.optimizer is the torch optimizer (its
step() and zero_grad() harmless, an LR scheduler works without warnings), and misuse gets a
clear error before any state changes: a bad factory, a parameter missing from the optimizer,
max_grad_norm without offload_to_cpu, clipping gradients that no longer exist."""

from __future__ import annotations

import functools
import pickle
import warnings

import pytest
import torch
from dist_harness import run_ranks
from in_backward_models import InBackwardLockStep, completed_allreduce_hook, train_lock_step
from lowbit_models import Blockwise8bit, Momentum8bit
from torch import nn

import leanddp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
ADAGRAD = functools.partial(torch.optim.Adagrad, lr=1e-2)
AMSGRAD = functools.partial(torch.optim.AdamW, lr=1e-2, amsgrad=True)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_step(ddp: nn.Module) -> None:
    ddp(torch.randn(3, 4)).square().mean().backward()


def _errors(rank: int, world_size: int) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]

    def build(**kwargs):
        return leanddp.DistributedDataParallel(model, **kwargs)

    with pytest.raises(TypeError, match="optimizer_in_backward must be a callable"):
        build(optimizer_in_backward=torch.optim.AdamW([nn.Parameter(torch.ones(1))]))
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got list"):
        build(optimizer_in_backward=lambda params: list(params))
    with pytest.raises(ValueError, match=r"does not hold parameter '2.weight'"):
        build(optimizer_in_backward=lambda params: torch.optim.SGD(model[0].parameters(), lr=1))
    stranger = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="does not train"):
        build(optimizer_in_backward=lambda params: torch.optim.SGD([*params, stranger], lr=1))
    with pytest.raises(ValueError, match="max_grad_norm needs optimizer_in_backward with offload"):
        build(optimizer_in_backward=ADAMW, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build(max_grad_norm=1.0)
    offload = dict(optimizer_in_backward=ADAMW, offload_to_cpu=True)
    for bad, error, message in [
        (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be positive and finite"),
        (dict(max_grad_norm=float("inf")), ValueError, "max_grad_norm must be positive"),
        (dict(max_grad_norm="1"), TypeError, "max_grad_norm must be a number"),
        (dict(offload_threads=0), ValueError, "offload_threads must be a positive int"),
        (dict(optimizer_in_backward=ADAGRAD), ValueError, "fused kernels.*got Adagrad"),
        (dict(optimizer_in_backward=AMSGRAD), ValueError, "AdamW with amsgrad"),
    ]:
        with pytest.raises(error, match=message):
            build(**{**offload, **bad})
    model.double()
    with pytest.raises(ValueError, match="parameter '0.weight' is torch.float64"):
        build(**offload)
    model.float()
    scaler = torch.amp.GradScaler("cpu")
    for bad, error, message in [
        (dict(grad_scaler=scaler), ValueError, "grad_scaler is for optimizer_in_backward"),
        (dict(optimizer_in_backward=ADAMW, grad_scaler=object()), TypeError, "GradScaler, got"),
        ({**offload, "grad_scaler": scaler}, ValueError, "grad_scaler is not supported with"),
        (dict(optimizer_in_backward=ADAGRAD, grad_scaler=scaler), ValueError, "got Adagrad"),
        (
            dict(optimizer_in_backward=ADAMW, grad_scaler=scaler, check_for_nan_in_grad=True),
            ValueError,
            "check_for_nan_in_grad and grad_scaler",
        ),
    ]:
        with pytest.raises(error, match=message):
            build(**bad)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.grad is None  # nothing changed before the errors


def test_bad_arguments_raise_before_any_state_changes() -> None:
    run_ranks(1, _errors)


def _loop(rank: int, world_size: int) -> None:
    model = _model()
    ddp = leanddp.DistributedDataParallel(model, optimizer_in_backward=ADAMW)
    opt = ddp.optimizer
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "AdamW"
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            snapshot = [p.detach().clone() for p in model.parameters()]
            _train_step(ddp)
            assert all(
                not torch.equal(p, s) for p, s in zip(model.parameters(), snapshot, strict=True)
            )
            after = [p.detach().clone() for p in model.parameters()]
            assert opt.step() is None  # harmless: the step already happened in backward
            opt.zero_grad()
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), after, strict=True))
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    # A closure is evaluated (its backward steps), as torch's step(closure) would.
    losses = []

    def closure():
        out = ddp(torch.randn(3, 4)).square().mean()
        out.backward()
        losses.append(out.item())
        return out

    assert opt.step(closure) is not None and len(losses) == 1

    with pytest.raises(NotImplementedError, match="cannot be added after wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(RuntimeError, match="optimizer_in_backward"):
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="nothing left to clip"):
        torch.nn.utils.clip_grad_value_(model[0].weight, 1.0)
    other = nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)  # other parameters: untouched
    assert other.weight.grad.norm() <= 1e-3 + 1e-6
    with pytest.raises(RuntimeError, match="cannot be pickled"):
        pickle.dumps(ddp)
    stats = ddp.memory_stats()
    params = stats["param_bytes"]
    # AdamW: two state tensors per parameter, plus one 4-byte step counter each.
    assert stats["optimizer_state_bytes"] == 2 * params + 4 * len(list(model.parameters()))
    assert stats["bucket_bytes"] == 0 and stats["grad_bytes"] == 0


def test_training_loop_and_optimizer_facade() -> None:
    run_ranks(1, _loop)


def _accumulation(rank: int, world_size: int) -> None:
    model = _model()
    ddp = leanddp.DistributedDataParallel(model, optimizer_in_backward=ADAMW)
    _train_step(ddp)  # first iteration, then the buckets are rebuilt
    for _ in range(2):
        with ddp.no_sync():
            _train_step(ddp)
            ptrs = [p.grad.data_ptr() for p in model.parameters()]
            held = ddp.memory_stats()
            _train_step(ddp)
            # accumulated in place, in the bucket views: no new allocation per micro-batch
            assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
            assert ddp.memory_stats() == held and held["grads_outside"] == 0
            assert held["bucket_bytes"] == held["param_bytes"]
        _train_step(ddp)
        assert all(p.grad is None for p in model.parameters())
        assert ddp.memory_stats()["bucket_bytes"] == 0


def test_no_sync_accumulates_in_place() -> None:
    run_ranks(2, _accumulation)


class SavedWeight(nn.Module):
    """Uses ``a.weight`` without grad (saved for backward) before its use with grad: its
    gradient is complete, and its bucket stepped, before the node that saved it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.pre(x) @ self.a.weight.detach())


def _stale_saved_weight(rank: int, world_size: int) -> None:
    for factory in (ADAMW, functools.partial(torch.optim.Adagrad, lr=1e-2)):  # fused, fallback
        ddp = leanddp.DistributedDataParallel(
            SavedWeight(), bucket_cap_mb=1e-5, optimizer_in_backward=factory
        )
        # each bucket is stepped at its launch
        ddp.register_comm_hook(None, completed_allreduce_hook)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _train_step(ddp)


def test_a_weight_autograd_still_needs_is_an_error_not_a_wrong_gradient() -> None:
    run_ranks(1, _stale_saved_weight)


def _load_changes_groups(rank: int, world_size: int) -> None:
    """A checkpoint whose param_groups turn momentum on loads (the state layout follows the
    loaded groups, not the ones in use before)."""
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    ddp = leanddp.DistributedDataParallel(_model(), optimizer_in_backward=sgd)
    _train_step(ddp)
    source = torch.optim.SGD(ddp.module.parameters(), lr=0.05, momentum=0.9)
    for p in ddp.module.parameters():
        p.grad = torch.ones_like(p)
    source.step()
    for p in ddp.module.parameters():
        p.grad = None
    ddp.optimizer.load_state_dict(source.state_dict())
    state = ddp.optimizer.state_dict()
    assert state["param_groups"][0]["momentum"] == 0.9
    for k, p in enumerate(ddp.module.parameters()):
        torch.testing.assert_close(state["state"][k]["momentum_buffer"], torch.ones_like(p))
    _train_step(ddp)  # steps with the loaded momentum buffers


def test_load_state_dict_with_other_hyper_parameters() -> None:
    run_ranks(1, _load_changes_groups)


def _clip_imported_early(rank: int, world_size: int) -> None:
    # The common idiom: references taken before any wrapper exists.
    from torch.nn.utils import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_
    from torch.nn.utils.clip_grad import clip_grad_norm

    model = _model()
    ddp = leanddp.DistributedDataParallel(model, optimizer_in_backward=ADAMW)
    _train_step(ddp)
    calls = [
        lambda: clip_grad_norm_(model.parameters(), 1.0),
        lambda: clip_grad_norm(model.parameters(), 1.0),
        lambda: clip_grad_value_(model[0].weight, 1.0),
        lambda: clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(2.0)),
        lambda: torch.nn.utils.clip_grad_norm_(list(ddp.parameters()), 1.0),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="nothing left to clip"):
            call()
    # the same references still clip other parameters
    other = nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    assert float(clip_grad_norm_(other.parameters(), 1e-3)) > 1e-3
    assert other.weight.grad.norm() <= 1e-3 + 1e-6


def test_clipping_imported_before_wrapping_raises() -> None:
    run_ranks(1, _clip_imported_early)


def _subclass_state(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 32))  # sizes: blocks of 32
    factory = functools.partial(Momentum8bit, lr=1e-2)
    run = InBackwardLockStep(model, factory, with_scheduler=False, fused_reference=False)
    train_lock_step(run, "8-bit momentum", accum=2, steps=3, exact=True)
    ours = list(run.ours.optimizer.state.values())
    assert ours and all(isinstance(s["momentum_buffer"], Blockwise8bit) for s in ours)

    def inner_bytes(states: list[dict]) -> int:
        return sum(s["momentum_buffer"].codes.nbytes + s["momentum_buffer"].scale.nbytes
                   for s in states)  # fmt: skip

    # The subclass has no storage of its own: its bytes are its codes' and scales'.
    stats = run.ours.memory_stats()
    assert stats["optimizer_state_bytes"] == inner_bytes(ours), stats
    assert inner_bytes(ours) == inner_bytes(list(run.ref_opt.state.values()))


def test_memory_stats_count_tensor_subclass_state() -> None:
    """Optimizer state held as a tensor subclass (as torchao's low-bit optimizers hold theirs),
    stepped by the per-bucket fallback: training equals torch's DDP + the same optimizer bit
    for bit, and memory_stats() counts the subclass's inner tensors."""
    run_ranks(2, _subclass_state)

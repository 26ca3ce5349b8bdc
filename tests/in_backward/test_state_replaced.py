"""optimizer_in_backward: optimizer state replaced rather than written in place (Lightning's
move of a loaded state to the root device, ``opt.state[p]["exp_avg"] = t`` in user code).

torch's DDP + the same torch optimizer, given the same replacement, is the reference: the
parameters and the optimizer's state_dict() agree after every step, with and without
offload_to_cpu. A whole ``state[p]`` replaced, one key replaced (in another dtype, as a move
to another device or dtype gives), ``step`` replaced, a state reset to ``{}``; a value of the
wrong shape raises, naming the parameter and the key.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep, assert_params_close

BATCH = 6

Replace = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _pairs(run: InBackwardLockStep) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, torch's parameter, ours) for the parameters torch's optimizer has state for."""
    ours = dict(run.ours.module.named_parameters())
    return [(n, p, ours[n]) for n, p in run.ref.module.named_parameters() if p in run.ref_opt.state]


def _replace_entries(run: InBackwardLockStep, change: Replace) -> list[torch.Tensor]:
    """Replaces every ``state[p]`` dict on both sides by new ones whose tensors ``change``
    made (ours, torch's); returns the tensors given to ours."""
    given = []
    for _, a, b in _pairs(run):
        mine, theirs = {}, {}
        for key, value in run.ref_opt.state[a].items():
            mine[key], theirs[key] = change(key, value)
            given.append(mine[key])
        run.ref_opt.state[a] = theirs
        run.ours.optimizer.state[b] = mine
    return given


def _replace_key(run: InBackwardLockStep, key: str, change: Replace) -> list[torch.Tensor]:
    """Replaces ``state[p][key]`` on both sides; returns the tensors given to ours."""
    given = []
    for _, a, b in _pairs(run):
        mine, theirs = change(key, run.ref_opt.state[a][key])
        run.ref_opt.state[a][key] = theirs
        run.ours.optimizer.state[b][key] = mine
        given.append(mine)
    return given


def _scaled(key: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new = value + 3 if key == "step" else value * 0.5  # a clone with other values
    return new.clone(), new.clone()


def _float64(key: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    new = value * -0.25  # exact in float32: ours gets it in float64, torch in float32
    return new.double(), new


def _check(run: InBackwardLockStep, what: str, given: list[torch.Tensor]) -> None:
    """Two steps equal to torch's; ours' state is leanddp's buffers again, equal to torch's."""
    for step in range(2):
        run.step([torch.randn(BATCH, 12) for _ in range(2)])
        assert_params_close(run, f"{what}, step {step}")
    for name, a, b in _pairs(run):
        assert run.ours.optimizer.state[b].keys() == run.ref_opt.state[a].keys(), (what, name)
        for key, mine in run.ours.optimizer.state[b].items():
            assert not any(mine is t for t in given), f"{what} {name} {key}: not re-pointed"
    ours, ref = run.ours.optimizer.state_dict()["state"], run.ref_opt.state_dict()["state"]
    assert ours.keys() == ref.keys(), what
    for index, entry in ref.items():
        assert ours[index].keys() == entry.keys(), (what, index)
        for key, value in entry.items():
            torch.testing.assert_close(
                ours[index][key].to(value), value, rtol=1e-5, atol=1e-6, msg=f"{what} {index} {key}"
            )


def _replaced(rank: int, world_size: int, name: str, offload: bool) -> None:
    run = InBackwardLockStep(Net(rank=rank, f64=False), OPTIMIZERS[name], offload=offload)
    for _ in range(2):
        run.step([torch.randn(BATCH, 12)])
    assert_params_close(run, "before")
    _check(run, "whole state[p]", _replace_entries(run, _scaled))
    key = "exp_avg" if "adam" in name else "momentum_buffer"
    _check(run, f"{key} in float64", _replace_key(run, key, _float64))
    if "adam" in name:
        step = _replace_key(run, "step", lambda k, v: (torch.tensor(10.0), torch.tensor(10.0)))
        _check(run, "step", step)
    for _, a, b in _pairs(run):  # start over, as from an empty state
        run.ref_opt.state[a] = {}
        run.ours.optimizer.state[b] = {}
    _check(run, "reset", [])

    # A value that cannot be adopted raises at the next forward, naming what it is.
    b = run.ours.module.head.weight
    state = run.ours.optimizer.state[b]
    good = state[key]
    state[key] = torch.zeros(3)
    with pytest.raises(ValueError, match=rf"'head.weight', key '{key}': shape \(3,\)"):
        run.ours(torch.randn(BATCH, 12))
    state[key] = good.to(torch.int64)
    with pytest.raises(ValueError, match=rf"'head.weight', key '{key}'.*floating-point"):
        run.ours(torch.randn(BATCH, 12))


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_replaced_state_is_adopted_as_torch_uses_it(name: str, offload: bool) -> None:
    run_ranks(2, _replaced, name, offload)

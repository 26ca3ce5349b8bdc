"""Which modes combine: docs/architecture.md's table, cell by cell. The rules are written once,
in C++ (`leanddp._C.check_modes`, csrc/modes.h): the table must say what it says, cell by cell and
pair by pair (fast, no process group). End to end, a "yes" trains two steps (with accumulation
where the column is `no_sync()`) and the ranks end with equal, moved, finite weights; a "no"
raises at construction (or at `register_comm_hook`) with an error naming the argument, before
anything is built. Every pair of features the table allows in a mode works together too, except
the one pair it names (NaN check and GradScaler)."""

from __future__ import annotations

import copy
import functools
import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
#: the table's rows, in order, and the constructor arguments of each mode
MODES: dict[str, dict[str, Any]] = {
    "DDP": {},
    "`optimizer_in_backward`": {"optimizer_in_backward": ADAMW},
    "+ `offload_to_cpu`": {"optimizer_in_backward": ADAMW, "offload_to_cpu": True},
    "+ `shard_optimizer_state`": {"optimizer_in_backward": ADAMW, "shard_optimizer_state": True},
    "+ both": {
        "optimizer_in_backward": ADAMW,
        "offload_to_cpu": True,
        "shard_optimizer_state": True,
    },
}
#: the table's columns, in order: (header, constructor arguments, the word a "no" error names)
FEATURES: list[tuple[str, dict[str, Any], str]] = [
    ("`max_grad_norm`", {"max_grad_norm": 1.0}, "max_grad_norm"),
    ("`check_for_nan_in_grad`", {"check_for_nan_in_grad": True}, "check_for_nan_in_grad"),
    ('`"strict"`', {"check_for_nan_in_grad": "strict"}, "check_for_nan_in_grad"),
    ("`grad_scaler`", {"grad_scaler": "scaler"}, "grad_scaler"),
    ("comm hook", {"hook": True}, "register_comm_hook"),
    ("sparse gradients", {"sparse": True}, "sparse"),
    ("`no_sync()`", {"accumulate": True}, ""),
]
#: arguments no mode combines, though each alone may be allowed
NEVER_TOGETHER = {frozenset({"check_for_nan_in_grad", "grad_scaler"})}
#: the rows and columns as `_C.Modes` fields (`no_sync()` is no mode: nothing to ask for)
MODE_FIELDS: dict[str, dict[str, Any]] = {
    "DDP": {},
    "`optimizer_in_backward`": {"optimizer_in_backward": True},
    "+ `offload_to_cpu`": {"optimizer_in_backward": True, "offload_to_cpu": True},
    "+ `shard_optimizer_state`": {"optimizer_in_backward": True, "shard_optimizer_state": True},
    "+ both": {
        "optimizer_in_backward": True,
        "offload_to_cpu": True,
        "shard_optimizer_state": True,
    },
}
FEATURE_FIELDS: dict[str, dict[str, Any]] = {
    "`max_grad_norm`": {"max_grad_norm": True},
    "`check_for_nan_in_grad`": {"check_for_nan_in_grad": _C.NanCheck.on},
    '`"strict"`': {"check_for_nan_in_grad": _C.NanCheck.strict},
    "`grad_scaler`": {"grad_scaler": True},
    "comm hook": {"comm_hook": True},
    "sparse gradients": {"sparse_parameter": "weight"},
    "`no_sync()`": {},
}


def doc_table() -> dict[tuple[str, str], bool]:
    """(mode, feature) -> whether docs/architecture.md says they combine."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| mode | `max_grad_norm`"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert header[1:] == [name for name, _, _ in FEATURES]
    table = {}
    for line in lines[start + 2 : start + 2 + len(MODES)]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] in MODES, cells[0]
        for (name, _, _), cell in zip(FEATURES, cells[1:], strict=True):
            assert cell.split()[0].rstrip(":") in ("yes", "no"), cell
            table[cells[0], name] = cell.startswith("yes")
    assert len(table) == len(MODES) * len(FEATURES)
    return table


def _check_modes(mode: str, features: tuple[str, ...]) -> Any:
    """`_C.check_modes` of the mode with `features`: None, or the rule it breaks."""
    fields = dict(MODE_FIELDS[mode])
    for name in features:
        fields.update(FEATURE_FIELDS[name])
    return _C.check_modes(_C.Modes(**fields))


def test_the_one_source_of_the_rules_says_what_the_table_says() -> None:
    table = doc_table()
    assert list(MODE_FIELDS) == list(MODES) and list(FEATURE_FIELDS) == [n for n, _, _ in FEATURES]
    words = {name: word for name, _, word in FEATURES}
    for (mode, feature), allowed in table.items():
        error = _check_modes(mode, (feature,))
        assert (error is None) == allowed, (mode, feature, error)
        if error is not None:
            assert words[feature] in error.message and error.argument in error.message, error
    for mode in MODES:
        for a, b in itertools.combinations([n for n, _, _ in FEATURES], 2):
            if words[a] == words[b]:
                continue  # one argument's two values
            together = {words[a], words[b]} not in NEVER_TOGETHER
            allowed = table[mode, a] and table[mode, b] and together
            assert (_check_modes(mode, (a, b)) is None) == allowed, (mode, a, b)


def test_modes_hold_each_companion_rule() -> None:
    """The rules outside the table: the companions of offload_to_cpu, and a disabled
    GradScaler (which scales nothing) with offload_to_cpu. Modes pickle and copy (a pickled
    wrapper keeps the modes it was built with)."""
    offload = {"optimizer_in_backward": True, "offload_to_cpu": True}
    for name in ("accumulate_on_host", "offload_threads"):
        error = _C.check_modes(_C.Modes(optimizer_in_backward=True, **{name: True}))
        assert error is not None and error.argument == name and "offload_to_cpu" in error.message
        assert _C.check_modes(_C.Modes(**offload, **{name: True})) is None
    scaler = {"grad_scaler": True, "grad_scaler_enabled": False}
    assert _C.check_modes(_C.Modes(**offload, **scaler)) is None
    assert _C.check_modes(_C.Modes(optimizer_in_backward=True)) is None
    modes = _C.Modes(**offload, check_for_nan_in_grad=_C.NanCheck.strict, sparse_parameter="w")
    assert pickle.loads(pickle.dumps(modes)) == modes == copy.copy(modes)
    assert modes != _C.Modes(**offload)


def _try(mode: str, features: tuple[str, ...]) -> str | None:
    """Builds the mode with `features` and trains two steps; None if all went well, else the
    error's text (an error after construction and hook registration fails the test)."""
    kw = dict(MODES[mode])
    extra: dict[str, Any] = {}
    for name in features:
        extra.update(next(f for n, f, _ in FEATURES if n == name))
    if extra.pop("grad_scaler", None):
        kw["grad_scaler"] = torch.amp.GradScaler("cpu")
    hook, sparse, accumulate = (extra.pop(k, False) for k in ("hook", "sparse", "accumulate"))
    kw.update(extra)
    module = nn.EmbeddingBag(16, 8, sparse=True) if sparse else nn.Linear(8, 8)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        ddp = leanddp.DistributedDataParallel(module, **kw)
        if hook:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as e:
        return str(e)
    in_backward = "optimizer_in_backward" in kw
    optimizer = ddp.optimizer if in_backward else torch.optim.SGD(ddp.parameters(), lr=0.1)

    def backward() -> None:
        x = torch.randint(0, 16, (4, 3)) if sparse else torch.randn(4, 8)
        ddp(x).square().sum().backward()

    for _ in range(2):
        if accumulate:
            with ddp.no_sync():
                backward()
        backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad()
    ddp.synchronize()  # the last steps' weights are in place
    for p, b in zip(ddp.module.parameters(), before, strict=True):
        w = p.detach().clone()
        assert torch.isfinite(w).all() and not torch.equal(w, b), (mode, features)
        others = [torch.empty_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(others, w)
        assert all(torch.equal(o, w) for o in others), (mode, features)
    return None


def _check_matrix(rank: int, world_size: int, table: dict[tuple[str, str], bool]) -> None:
    words = {name: word for name, _, word in FEATURES}
    for (mode, feature), allowed in table.items():
        error = _try(mode, (feature,))
        if allowed:
            assert error is None, f"{mode} with {feature}: {error}"
        else:
            assert error is not None, f"{mode} with {feature} works, the table says no"
            assert words[feature] in error, (mode, feature, error)
    for mode in MODES:
        for a, b in itertools.combinations([n for n, _, _ in FEATURES], 2):
            if words[a] == words[b]:
                continue  # one argument's two values
            together = {words[a], words[b]} not in NEVER_TOGETHER
            allowed = table[mode, a] and table[mode, b] and together
            error = _try(mode, (a, b))
            assert (error is None) == allowed, (mode, a, b, error)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_modes_combine_as_the_table_says() -> None:
    run_ranks(2, _check_matrix, doc_table())

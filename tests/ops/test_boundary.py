"""The `_C` boundary: the Reducer reduces and the in-backward optimizer steps, each with its own
methods; the values that cross into the optimizer are typed (no string-keyed dicts or kind
strings); the test seams live in `_C._testing`, not beside the product."""

from __future__ import annotations

import pytest
import torch

from leanddp._extension import _C

#: What the Reducer once offered only to reach the optimizer: optimizer state and its loading,
#: step counts, masters, groups, GradScaler, generation, offload stats and delays, and the
#: forward-side waits.
OPTIMIZER_ONLY = {
    "set_optimizer_groups", "set_grad_scaler", "optimizer_state", "load_optimizer_state",
    "gathered_optimizer_state", "shard_placement", "local_optimizer_state", "optimizer_steps",
    "set_optimizer_steps", "optimizer_generation", "load_master_weight", "adopt_master_weights",
    "offload_stats", "wait_for_steps", "pending_steps", "follow_steps", "wait_for_bucket",
    "_delay_host_steps", "_delay_copies_back", "_copy_back_stream", "_inject_host_faults",
}  # fmt: skip


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("__")}


def test_the_reducer_has_no_optimizer_methods() -> None:
    assert not _public(_C.Reducer) & OPTIMIZER_ONLY, "the Reducer reaches the optimizer"
    core = _public(_C.InBackwardOptimizer)
    for name in ("state", "load_state", "gathered_state", "shard_placement", "local_state",
                 "steps", "set_steps", "set_groups", "set_grad_scaler", "generation", "stats",
                 "pending_steps", "follow_steps", "wait_for_bucket", "wait_for_steps"):  # fmt: skip
        assert name in core, name


def test_hyper_parameters_and_kind_are_typed() -> None:
    hyper = _C.OptimHyper(lr=0.5, beta1=0.8, weight_decay=0.1, decoupled=True)
    assert (hyper.lr, hyper.beta1, hyper.weight_decay, hyper.decoupled) == (0.5, 0.8, 0.1, True)
    assert hyper.lr_tensor is None and hyper.eps == 1e-8
    lr = torch.tensor(0.25)
    assert _C.OptimHyper(lr=0.0, lr_tensor=lr).lr_tensor is lr
    with pytest.raises(TypeError):
        _C.OptimHyper(lr="0.5")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _C.OptimHyper(lr=0.5, betas=(0.9, 0.99))  # type: ignore[call-arg]
    options = _C.InBackwardOptions()
    options.kind = _C.OptimKind.adam
    assert options.kind == _C.OptimKind.adam
    with pytest.raises(TypeError):
        options.kind = "adam"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        options.groups = [{"lr": 0.5}]  # type: ignore[list-item]


def test_test_seams_live_in_their_own_module() -> None:
    seams = {"StepWindow", "set_host_ordering", "host_ordering_counts", "reduce_to_shard",
             "reduces_scattered", "pack_and_gather_shards", "offload_released_on_worker",
             "parallel_threads", "HostFault"}  # fmt: skip
    assert seams <= _public(_C._testing)
    product = _public(_C)
    assert not {name for name in product if name.lstrip("_") in seams}, "a seam in _C itself"

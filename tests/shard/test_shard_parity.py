"""shard_optimizer_state against torch's DDP followed by the same torch optimizer, in the same
processes, on random data, over several steps: parameters within 1e-5 relative at world sizes 2
and 3 (3 forces padding and parameters cut by shard boundaries, which the test checks happen),
for SGD and Adam(W), parameter groups, an LR scheduler, no_sync accumulation, tiny buckets,
unused parameters, static graphs, views off, global-norm clipping and bfloat16 parameters,
on the device and with offload_to_cpu (host state and masters); and the optimizer state: 1/N
of it per rank, and checkpoints interchanged with the plain torch optimizer in both directions.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import (
    LAYER_BYTES,
    OPTIMIZERS,
    Deep,
    InBackwardLockStep,
    completed_allreduce_hook,
    scheduler,
    train_lock_step,
)
from lowp_models import assert_within_ulps, lowp_pair, mean_square, ulp_tolerance

import leanddp

pytestmark = pytest.mark.leanddp_paths

STEPS = 5
BATCH = 6
SHARD = dict(shard_optimizer_state=True)


def _cut_parameters(ddp: leanddp.DistributedDataParallel) -> int:
    """How many parameters a shard boundary cuts (with pieces on more than one rank), as the
    Reducer cut them."""
    placement = ddp._optimizer_core.shard_placement()
    return sum(1 for pieces in placement if len({rank for rank, _, _ in pieces}) > 1)


def _unsharded_state_bytes(ddp: leanddp.DistributedDataParallel, kind: str) -> int:
    """Bytes of fused state a rank would hold unsharded (float32: 2 buffers for Adam, 1 for SGD
    with momentum)."""
    numel = sum(p.numel() for p in ddp._params)
    return numel * 4 * (2 if kind == "adam" else 1)


def _train(
    run: InBackwardLockStep, what: str, accum: int, steps: int = STEPS, static: bool = False
) -> None:
    train_lock_step(run, what, accum, steps, static)
    assert len(run.ours.optimizer.state) == 0, f"{what}: optimizer.state holds whole state"


def _matrix(rank: int, world_size: int, names: list[str], full: bool) -> None:
    # (every accumulation x bucket size combination for the first names; two for the others)
    combos = list(itertools.product((1, 3), (False, True))) if full else [(1, True), (3, False)]
    for name, (accum, tiny) in itertools.product(names, combos):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False),
            OPTIMIZERS[name],
            bucket_cap_mb=0.0005 if tiny else None,
            ours_kwargs=SHARD,
        )
        what = f"world={world_size} {name} accum={accum} tiny={tiny}"
        _train(run, what, accum)
        state = run.ours.memory_stats()["optimizer_state_bytes"]
        kind = "adam" if "adam" in name else "sgd"
        whole = _unsharded_state_bytes(run.ours, kind)
        buckets = len(run.ours.reducer.bucket_indices())
        pad = buckets * world_size * 4 * 4 * (2 if kind == "adam" else 1)  # 4 floats per rank
        if "plain" not in name:
            assert whole / world_size <= state <= whole / world_size + pad, (
                f"{what}: {state} bytes of state on rank {rank}, whole {whole}"
            )
        if world_size == 3 and tiny:
            assert _cut_parameters(run.ours) > 0, f"{what}: no parameter cut by a shard boundary"


@pytest.mark.parametrize(
    "world_size,names,full",
    [
        (2, ["adamw", "sgd-nesterov"], True),
        (3, ["adamw", "sgd-nesterov"], True),
        (2, ["adam", "sgd-dampening", "adamw-groups", "sgd-groups"], False),
    ],
    ids=["adamw-sgd-2", "adamw-sgd-3", "more-2"],
)
def test_parity_with_torch_ddp_and_optimizer(world_size: int, names: list[str], full: bool) -> None:
    run_ranks(world_size, _matrix, names, full)


def _variants(rank: int, world_size: int) -> None:
    variants = [
        dict(gradient_as_bucket_view=False),
        dict(find_unused_parameters=True, unused=True),
        dict(static_graph=True, unused=True),
        dict(bucket_cap_mb=0.0005, max_grad_norm=0.05),
        dict(max_grad_norm=100.0),  # never clips: the coefficient is clamped to 1
    ]
    for kwargs, name, accum in itertools.product(variants, ("sgd-nesterov", "adamw"), (1, 3)):
        kwargs = dict(kwargs)
        unused = kwargs.pop("unused", False)
        clip = kwargs.pop("max_grad_norm", None)
        run = InBackwardLockStep(
            Net(unused=unused, rank=rank, f64=False),
            OPTIMIZERS[name],
            max_grad_norm=clip,
            ours_kwargs=dict(SHARD, max_grad_norm=clip),
            **kwargs,
        )
        what = f"world={world_size} {name} {kwargs} unused={unused} clip={clip} accum={accum}"
        _train(run, what, accum, static=kwargs.get("static_graph", False))
        if clip is not None:
            norm = run.ours.offload_stats()["grad_norm"]
            assert norm == pytest.approx(run.ref_norm, rel=1e-5), f"{what}: norm {norm}"
            if clip < 1:
                assert run.ref_norm > clip, f"{what}: the case never clipped"
        if unused:
            assert rank != 0 or run.ours.module.branch.weight.grad is None
            torch.testing.assert_close(run.ours.module.never.weight, run.ref.module.never.weight)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_static_views_off_and_clipping(world_size: int) -> None:
    run_ranks(world_size, _variants)


def _bf16(rank: int, world_size: int) -> None:
    """bfloat16 parameters, state in bfloat16 as torch's fused AdamW keeps it: within an ulp of
    torch's fused AdamW, and bitwise equal to the unsharded in-backward steps."""
    dtype = torch.bfloat16
    kw = dict(lr=1e-2, weight_decay=0.1)
    factory = functools.partial(torch.optim.AdamW, **kw)
    ours, ref, ref_opt = lowp_pair(
        dtype, "cpu", factory, functools.partial(torch.optim.AdamW, fused=True, **kw), **SHARD
    )
    whole, _, _ = lowp_pair(dtype, "cpu", factory, factory)
    ulps, bitwise = ulp_tolerance("cpu", "adamw")
    for step in range(STEPS):
        x = torch.randn(6, 16, dtype=dtype)
        for model in (ours, ref, whole):
            mean_square(model, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_within_ulps(ours.module, ref.module, dtype, f"bf16 step {step}", ulps, bitwise)
        pairs = zip(ours.module.named_parameters(), whole.module.parameters(), strict=True)
        for (name, a), b in pairs:
            assert torch.equal(a, b), f"bf16 step {step}: {name} differs from the unsharded step"
    gathered = ours.optimizer.state_dict()["state"]
    assert gathered[0]["exp_avg"].dtype == dtype
    expected = whole.optimizer.state_dict()["state"]
    for index, entry in expected.items():
        for key, value in entry.items():
            assert torch.equal(gathered[index][key], value), f"bf16 state {index} {key}"


def test_bfloat16_parameters() -> None:
    world_size = 2  # (parameters cut between ranks: the 3-rank float32 cases)
    run_ranks(world_size, _bf16)


def _checkpoints(rank: int, world_size: int, name: str) -> None:
    # Sharded state gathered into torch's format: what torch's optimizer holds, and loadable
    # into the plain torch optimizer, which then steps on as the sharded one does.
    run = InBackwardLockStep(
        Net(rank=rank, f64=False),
        OPTIMIZERS[name],
        bucket_cap_mb=0.0005,
        ours_kwargs=SHARD,
        fused_reference=False,  # (the checkpoints compared and exchanged are the user's format)
    )
    _train(run, f"{name} before saving", accum=2, steps=3)
    saved = run.ours.optimizer.state_dict()  # every rank calls it: a collective
    expected = run.ref_opt.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert saved["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(saved["state"][index][key], value, rtol=1e-5, atol=1e-6)
    plain_model = copy.deepcopy(run.ours.module)
    plain = OPTIMIZERS[name](plain_model.parameters())
    plain.load_state_dict(saved)
    assert len(run.ours.optimizer.state) == 0, "state_dict() left the gathered state behind"

    # torch's checkpoint loaded into a fresh sharded wrapper (its state not created yet), which
    # then trains on in lock step with torch's DDP.
    fresh = leanddp.DistributedDataParallel(
        copy.deepcopy(run.ref.module),
        process_group=dist.new_group(),
        optimizer_in_backward=OPTIMIZERS[name],
        bucket_cap_mb=0.0005,
        **SHARD,
    )
    fresh.optimizer.load_state_dict(run.ref_opt.state_dict())
    assert len(fresh.optimizer.state) == 0, "load_state_dict() kept the whole state"
    run.ours = fresh
    run.scheds[1] = scheduler(fresh.optimizer)
    run.scheds[1].load_state_dict(run.scheds[0].state_dict())
    _train(run, f"{name} after loading torch's state", accum=1, steps=3)
    resaved = fresh.optimizer.state_dict()["state"]
    for index, entry in run.ref_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(resaved[index][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpoints_interchange_with_the_torch_optimizer(world_size: int) -> None:
    run_ranks(world_size, _checkpoints, "adamw-groups")


def _offload(rank: int, world_size: int) -> None:
    cases = [
        ("adamw", None, False, 1),
        ("adamw-groups", 0.05, True, 3),
        ("sgd-nesterov", 0.05, True, 1),
    ]
    for name, clip, tiny, accum in cases:
        run = InBackwardLockStep(
            Net(rank=rank, f64=False),
            OPTIMIZERS[name],
            offload=True,
            max_grad_norm=clip,
            bucket_cap_mb=0.0005 if tiny else None,
            ours_kwargs=SHARD,
        )
        what = f"offload world={world_size} {name} clip={clip} tiny={tiny} accum={accum}"
        _train(run, what, accum)
        stats = run.ours.memory_stats()
        whole = sum(p.numel() for p in run.ours._params) * 4
        buckets = len(run.ours.reducer.bucket_indices())
        pad = buckets * world_size * 4 * 4
        # float32 masters on the host: this rank's shard of them (they are the staging buffer)
        master = stats["host_master_bytes"]
        assert whole / world_size <= master <= whole / world_size + pad, f"{what}: {master}"
        if clip is not None:
            norm = run.ours.offload_stats()["grad_norm"]
            assert norm == pytest.approx(run.ref_norm, rel=1e-5), f"{what}: norm {norm}"
            assert run.ref_norm > clip, f"{what}: the case never clipped"
        saved = run.ours.optimizer.state_dict()["state"]
        for index, entry in run.ref_opt.state_dict()["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(saved[index][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_offload_to_cpu(world_size: int) -> None:
    run_ranks(world_size, _offload)


def _offload_bf16(rank: int, world_size: int) -> None:
    """bfloat16 parameters with float32 masters on the host: bitwise the unsharded offload, and
    the gathered state (masters included) is the unsharded one; loaded into fresh wrappers, the
    sharded one goes on bitwise as the unsharded one."""
    dtype = torch.bfloat16
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ours, _, _ = lowp_pair(dtype, "cpu", factory, factory, offload_to_cpu=True, **SHARD)
    whole, _, _ = lowp_pair(dtype, "cpu", factory, factory, offload_to_cpu=True)

    def train(models: tuple, steps: int) -> None:
        for step in range(steps):
            x = torch.randn(6, 16, dtype=dtype)
            for model in models:
                mean_square(model, x).backward()
                model.optimizer.step()
            pairs = zip(
                models[0].module.named_parameters(), models[1].module.parameters(), strict=True
            )
            for (name, a), b in pairs:
                assert torch.equal(a, b), f"offload bf16 step {step}: {name} differs"

    train((ours, whole), 3)
    gathered = ours.optimizer.state_dict()
    expected = whole.optimizer.state_dict()
    for index, entry in expected["state"].items():
        assert gathered["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(gathered["state"][index][key], value), f"{index} {key}"
    # The same checkpoint loaded into a fresh sharded and a fresh unsharded wrapper: they go on
    # bitwise equal (torch's load_state_dict casts state to the parameters' dtype for both).
    fresh = [
        lowp_pair(dtype, "cpu", factory, factory, offload_to_cpu=True, **kw)[0]
        for kw in (SHARD, {})
    ]
    for model in fresh:
        with torch.no_grad():
            for a, b in zip(model.module.parameters(), whole.module.parameters(), strict=True):
                a.copy_(b)
        model.optimizer.load_state_dict(copy.deepcopy(expected))
    train(tuple(fresh), 2)


def test_offload_bfloat16_masters() -> None:
    world_size = 2  # (parameters cut between ranks: the 3-rank offload case)
    run_ranks(world_size, _offload_bf16)


def _comm_hook_refused(rank: int, world_size: int) -> None:
    ddp = leanddp.DistributedDataParallel(
        Net(rank=rank, f64=False), optimizer_in_backward=torch.optim.AdamW, **SHARD
    )
    with pytest.raises(RuntimeError, match="register_comm_hook is not supported with shard_opt"):
        ddp.register_comm_hook(None, completed_allreduce_hook)
    before = [p.detach().clone() for p in ddp.parameters()]
    ddp(torch.randn(BATCH, 12)).square().mean().backward()  # trains on without the hook
    assert any(not torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True))


def test_comm_hook_refused() -> None:
    run_ranks(2, _comm_hook_refused)


def _buckets_allocated(rank: int, world_size: int) -> None:
    ddp = leanddp.DistributedDataParallel(
        Deep(),
        bucket_cap_mb=LAYER_BYTES / 2**20,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-2),
        **SHARD,
    )
    for _ in range(4):
        ddp(torch.randn(4, 32)).square().mean().backward()
        stats = ddp.memory_stats()
        assert ddp.reducer.bucket_bytes() == [LAYER_BYTES] * 12 and stats["bucket_bytes"] == 0
        # a stepped bucket is kept until its gather finishes at the next step: the window holds
        # one launched bucket beside it, so two are allocated at once, as unsharded
        assert stats["max_buckets_in_flight"] == 1, stats
        assert stats["peak_bucket_bytes"] <= 2 * LAYER_BYTES, stats


def test_cpu_keeps_two_buckets_allocated_as_unsharded() -> None:
    """On the CPU the host waits for a bucket's all-gather at the next bucket's step, keeping the
    bucket until then; the window launches one bucket fewer, so no more are allocated at once
    than without sharding (csrc/reducer_step.cpp, set_optimizer)."""
    run_ranks(2, _buckets_allocated)

"""Faults inside offload_to_cpu's host worker, made on purpose with its fault injection
(``_inject_host_faults``, csrc/host_worker.h): a host addition of a no_sync() micro-batch
(accumulation on the host) or a host step that raises, on every rank or on one, replicated and
sharded, with and without max_grad_norm; and a rank that dies while its worker steps.

On every rank the error is raised at the same point (the forward after the synchronized
backward; sharded, that backward, whose gathers wait for the steps; or a full wait such as
synchronize() in the middle of the accumulation), no weight of the failed step changed, and the
loop that goes on (no zero_grad()) trains as torch's DDP that skipped that step: no later step
uses a sum the failure left partial. Where one rank fails, it raises and the other raises within
the process group's timeout; a rank that dies mid-step leaves no one hanging.

Each case runs replicated or sharded, the two in turn, swapped every other run by the run's seed
(LEANDDP_TEST_SEED; support/rotation.py): every run covers both, and over four seeds every case
meets both. The rank dying runs one of the two per run.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from fault_harness import PG_TIMEOUT, group, run_faulty
from fault_models import ADAMW, Poison, Tower, assert_close, batches
from rotation import alternate, this_runs_half

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.slow

TIMEOUT_S = PG_TIMEOUT.total_seconds()
STEPS, ACCUM, FAULT_AT = 4, 3, 1  # step FAULT_AT fails
FAULTY_BUCKET = 1  # the addition that fails: micro-batch 1's, of this bucket
SLOW = 0.3  # rank 0's worker is this much slower at what fails: it meets the error later
MESSAGE = "leanddp injected fault"


class Reference:
    """torch's DDP + torch AdamW (+ clip_grad_norm_), ``ACCUM`` micro-batches a step."""

    def __init__(self, model: torch.nn.Module, clip: float | None) -> None:
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group()
        )
        self.optimizer = ADAMW(self.ddp.parameters())
        self.clip = clip

    def step(self, micro: list[torch.Tensor]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for i, x in enumerate(micro):
            with contextlib.nullcontext() if i == len(micro) - 1 else self.ddp.no_sync():
                self.ddp(x).square().mean().backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.clip)
        self.optimizer.step()


def _wrap(
    model: torch.nn.Module, shard: bool, clip: float | None, pg: dist.ProcessGroup, cap=0.002
):
    return leanddp.DistributedDataParallel(
        copy.deepcopy(model), process_group=pg, bucket_cap_mb=cap,
        optimizer_in_backward=ADAMW, offload_to_cpu=True, shard_optimizer_state=shard,
        max_grad_norm=clip,
    )  # fmt: skip


def _params(ddp: leanddp.DistributedDataParallel) -> torch.Tensor:
    ddp.synchronize()
    return torch.cat([p.detach().flatten() for p in ddp.module.parameters()])


def _params_of(ref: Reference) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ref.ddp.module.parameters()])


def _step(ddp, micro, after_first=None, sync_after_first=False, last_hook=None) -> str | None:
    """One step of a loop that calls neither zero_grad() nor optimizer.step(): where the injected
    error was raised ("forward i", "backward i", "synchronize"), or None. ``after_first()`` runs
    after micro-batch 0, ``last_hook()`` before the last; ``sync_after_first``: synchronize() (a
    full wait) after micro-batch 1."""
    for i, x in enumerate(micro):
        last = i == len(micro) - 1
        if last and last_hook is not None:
            last_hook()
        with contextlib.nullcontext() if last else ddp.no_sync():
            for where in ("forward", "backward"):
                try:
                    if where == "forward":
                        out = ddp(x)
                    else:
                        out.square().mean().backward()
                except RuntimeError as e:
                    if MESSAGE not in str(e):
                        raise
                    return f"{where} {i}"
        if i == 0 and after_first is not None:
            after_first()
        if i == 1 and sync_after_first:
            try:
                ddp.synchronize()
            except RuntimeError as e:
                assert MESSAGE in str(e), e
                return "synchronize"
    return None


def _arm(ddp, kind: str, rank: int, faulty: tuple[int, ...]) -> None:
    """Step FAULT_AT's host job of ``kind`` fails on the ranks ``faulty``; rank 0's worker is
    SLOW at it (so it meets the error after rank 1)."""
    core = ddp._optimizer_core
    if kind == "step":
        core._delay_host_steps(SLOW if rank == 0 else 0)
        if rank in faulty:  # this step's first host step (no bucket is stepped before it)
            core._inject_host_faults(_C._testing.HostFault.step, 1)
    else:
        delays = [0.0] * len(ddp.reducer.bucket_indices())
        delays[FAULTY_BUCKET] = SLOW if rank == 0 else 0
        ddp.reducer._delay_additions(delays)
        if rank in faulty:  # (armed after micro-batch 0: micro-batch 1's addition fails)
            core._inject_host_faults(_C._testing.HostFault.addition, 1, FAULTY_BUCKET)


def _probe(ddp, x: torch.Tensor) -> str | None:
    """The next step's first forward (a no_sync() one, no backward): "next forward" if it raised
    the injected error."""
    try:
        with ddp.no_sync():
            ddp(x)
    except RuntimeError as e:
        assert MESSAGE in str(e), e
        return "next forward"
    return None


def _on_every_rank(rank: int, world_size: int, kind: str, shard: bool, surface: str) -> dict:
    """Step FAULT_AT's host job of ``kind`` fails on every rank: where each raised, per clip."""
    raised_at: dict = {}
    for clip in (None, 0.05):  # (0.05 clips every step)
        torch.manual_seed(7)
        model = Tower(poison_at="none")
        data = batches(STEPS, ACCUM, seed=3)
        ref = Reference(model, clip)
        ours = _wrap(model, shard, clip, dist.new_group(timeout=PG_TIMEOUT))
        for step, micro in enumerate(data):
            if step != FAULT_AT:
                ref.step(micro)
                assert _step(ours, micro) is None, f"clip={clip} step {step}"
                what = f"clip={clip} step {step}"
                assert_close(_params(ours), _params_of(ref), "offload", what)
                continue
            before = _params(ours)
            arm = functools.partial(_arm, ours, kind, rank, (0, 1))
            if kind == "step":
                arm()
            where = _step(ours, micro, arm if kind == "addition" else None, surface == "sync")
            if where is None:  # (the next step then runs whole: its forward changed nothing)
                where = _probe(ours, data[step + 1][0])
            _arm(ours, kind, rank, ())  # (no delays from now on)
            raised_at[clip] = where
            after = _params(ours)
            assert torch.equal(after, before), f"clip={clip}: the failed step changed weights"
    return raised_at


SHARDING = {False: "replicated", True: "sharded"}


def _half(cases: list[tuple]) -> list[pytest.param]:
    """Each case once, replicated or sharded in turn (module docstring)."""
    return [
        pytest.param(*case, shard, id="-".join([SHARDING[shard], *case]))
        for j, case in enumerate(cases)
        for shard in [alternate(j, [False, True])]
    ]


@pytest.mark.parametrize(
    "kind,surface,shard",
    _half([("addition", "forward"), ("addition", "sync"), ("step", "forward")]),
)
def test_a_host_job_failing_on_every_rank(kind: str, surface: str, shard: bool) -> None:
    outcomes = run_faulty(2, _on_every_rank, kind, shard, surface, limit=240)
    for o in outcomes:
        assert o.error is None and not o.died, o.message
    # (sharded: the synchronized backward's gathers wait for the steps, and raise)
    expected = "synchronize" if surface == "sync" else "backward 2" if shard else "next forward"
    for clip in (None, 0.05):
        where = [o.value[clip] for o in outcomes]
        assert where == [expected] * 2, f"clip={clip}: raised at {where}"


def _on_one_rank(rank: int, world_size: int, kind: str, shard: bool) -> dict:
    """Step FAULT_AT's host job of ``kind`` fails on rank 1 only: it raises, then stays alive
    (gone from the loop); rank 0 trains on into the next synchronized backward."""
    torch.manual_seed(7)
    model = Tower(poison_at="none")
    data = batches(STEPS, ACCUM, seed=3)
    ours = _wrap(model, shard, None, group())
    for step in range(FAULT_AT):
        assert _step(ours, data[step]) is None
    before = _params(ours)
    arm = functools.partial(_arm, ours, kind, rank, (1,))
    if kind == "step":
        arm()
    out: dict = {}
    start = time.monotonic()
    try:
        where = _step(ours, data[FAULT_AT], arm if kind == "addition" else None)
        if where is None:
            where = _probe(ours, data[FAULT_AT + 1][0])
        if where is None:  # (rank 0: the next step's reductions wait for rank 1)
            assert _step(ours, data[FAULT_AT + 1]) is None
        out["where"] = where
        if rank == 1:
            time.sleep(TIMEOUT_S + 2)
    except RuntimeError as e:
        out["error"], out["elapsed"] = str(e), time.monotonic() - start
    out["unchanged"] = torch.equal(_params(ours), before)
    # (the default group: the training one timed out)
    weights = [torch.empty_like(before) for _ in range(world_size)]
    dist.all_gather(weights, _params(ours))
    out["agree"] = torch.equal(weights[0], weights[1])
    return out


@pytest.mark.parametrize("kind,shard", _half([("addition",), ("step",)]))
def test_a_host_job_failing_on_one_rank(kind: str, shard: bool) -> None:
    survivor, faulty = run_faulty(2, _on_one_rank, kind, shard, limit=180)
    assert survivor.error is None and faulty.error is None, survivor.message + faulty.message
    survivor, faulty = survivor.value, faulty.value
    assert faulty["where"] == ("backward 2" if shard else "next forward"), faulty
    assert "error" not in faulty, faulty
    assert "Another rank has probably died" in survivor.get("error", ""), survivor
    assert survivor["elapsed"] < 2 * SLOW + TIMEOUT_S + 10, survivor
    if shard:  # every rank's shard gathered: the same weights, the faulty rank's piece old
        assert survivor["agree"] and faulty["agree"]
    else:  # nothing of the failed step landed on the faulty rank
        assert faulty["unchanged"], faulty


STEP_DELAY = 3.0  # rank 1's host steps sleep this long: it dies in the middle


def _dies_while_stepping(rank: int, world_size: int, shard: bool) -> dict:
    torch.manual_seed(7)
    model = Tower(poison_at="none")
    data = batches(STEPS, ACCUM, seed=3)
    ours = _wrap(model, shard, None, group())
    assert _step(ours, data[0]) is None
    ours.synchronize()
    if rank == 1:  # its host steps sleep; it dies 0.3 s into the synchronized micro-batch
        ours._optimizer_core._delay_host_steps(STEP_DELAY)
    start = time.monotonic()
    try:
        for step in range(1, STEPS):
            _step(ours, data[step], last_hook=_die_soon if rank == 1 else None)
    except RuntimeError as e:
        return {"elapsed": time.monotonic() - start, "message": str(e)}
    return {"raised": False}


def _die_soon() -> None:
    threading.Timer(0.3, os._exit, (17,)).start()


@pytest.mark.parametrize("shard", this_runs_half([False, True]), ids=SHARDING.get)
def test_a_rank_dying_while_its_worker_steps(shard: bool) -> None:
    survivor, dead = run_faulty(2, _dies_while_stepping, shard, limit=120)
    assert dead.died, dead
    assert survivor.error is None, survivor.message
    result = survivor.value
    assert "elapsed" in result, f"rank 0 trained on after its peer died: {result}"
    assert result["elapsed"] < STEP_DELAY + TIMEOUT_S + 10, result


class _Pause(torch.autograd.Function):
    """Identity; its backward sleeps, so that the reductions launched before it are done when
    the next hook asks (the synchronized backward then steps their buckets in its hooks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return grad


def _unfinished(rank: int, world_size: int, buffers: bool) -> dict:
    """A synchronized backward raises part-way (Poison, after layers.0), one bucket per layer:
    layers 3 and 2's buckets were reduced during _Pause and their host steps queued in the
    hooks, the first of which fails on every rank (rank 0's worker SLOW: still stepping at the
    next forward, rank 1's done); layer 1's bucket was launched, not stepped (the next forward
    winds the backward up: it steps that bucket, or drops its step). The next forward raises
    the step's error: where (before or after the module's forward), and what the ranks hold."""
    torch.manual_seed(7)
    model = Tower(poison_at="first")
    model.layers[2].register_forward_pre_hook(lambda m, args: (_Pause.apply(args[0]),))
    if buffers:  # broadcast from rank 0 at each forward, between the two places to raise
        model.register_buffer("seen", torch.zeros(3))
    data = batches(STEPS, 1, seed=3)
    ours = _wrap(model, False, None, group(), cap=0.0005)
    for step in range(2):
        assert _step(ours, data[step]) is None
    assert len(ours.reducer.bucket_indices()) == 4  # (rebuilt in backward's order)
    before = _params(ours)
    _arm(ours, "step", rank, (0, 1))
    Poison.mode = "raise"
    try:
        ours(data[2][0]).square().mean().backward()
        raise AssertionError("the poisoned backward did not raise")
    except ValueError:
        pass
    finally:
        Poison.mode = None
    ran: list[int] = []
    ours.module.register_forward_pre_hook(lambda m, args: ran.append(1))
    out: dict = {"where": None}
    try:
        ours(data[3][0])
    except RuntimeError as e:
        assert MESSAGE in str(e), e
        out["where"] = "after module" if ran else "before module"
    _arm(ours, "step", rank, ())
    out["unchanged"] = torch.equal(_params(ours), before)
    assert _step(ours, data[3]) is None  # training goes on, in step on every rank
    state = torch.cat([_params(ours), *(b.flatten() for b in ours.module.buffers())])
    gathered = [torch.empty_like(state) for _ in range(world_size)]
    dist.all_gather(gathered, state)
    out["agree"] = torch.equal(gathered[0], gathered[1])
    return out


@pytest.mark.parametrize("buffers", [False, True], ids=["params", "buffers"])
def test_a_host_step_failing_in_a_backward_that_raised(buffers: bool) -> None:
    """Every rank raises the error at the same point of the next forward (before the module's,
    where the Reducer winds up the unfinished backward), no weight of that backward changed and
    training goes on alike on both ranks (with a buffer broadcast in between: no rank is left
    alone in the broadcast)."""
    outcomes = run_faulty(2, _unfinished, buffers, limit=120)
    for o in outcomes:
        assert o.error is None and not o.died, o.message
    values = [o.value for o in outcomes]
    assert [v["where"] for v in values] == ["before module"] * 2, values
    assert all(v["unchanged"] and v["agree"] for v in values), values

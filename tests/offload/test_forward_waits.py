"""offload_to_cpu's next forward waits for each bucket's host step where it reads the bucket.

After a backward the host worker may still be stepping; the wrapper's forward no longer waits
for all of it at its start: it waits for a bucket when a module that owns one of its parameters
is called, or when any torch function is given one of them, and the worker steps the buckets
the forward reads first first. Each step here delays the worker (so every bucket is pending when
the next forward starts) and checks, against torch's DDP + the same torch optimizer and LR
scheduler in the same processes on random data: the loss of every forward and the parameters
after it equal bit for bit (a stale read would change both), with a model that reads parameters
outside their owner's forward (``nn.MultiheadAttention``'s ``out_proj``, an embedding's weight
sliced by its parent, a tied output projection); and that the forward ran while later buckets
were still being stepped. Held steps (max_grad_norm) the same way; sharded offload keeps its
gathers at the end of backward; a compiled submodule makes the forward wait for everything at
its start. On a GPU (skipped without one) the same per-bucket checks, the waits then ordering the
current stream after each bucket's copy back.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from fault_models import ADAMW, Tower, nan_gradients
from in_backward_models import OPTIMIZERS, InBackwardLockStep, reference_optimizer, scheduler
from seam import host_ordered
from torch import nn

import leanddp

STEPS = 5
DELAY = 0.1  # seconds the worker sleeps before each host step
DIM, VOCAB, SEQ = 256, 256, 16


class ReadsOutsideOwners(nn.Module):
    """An embedding sliced by its parent, attention whose out_proj is read by its parent module
    (never called), a tied output projection: reads no module pre-hook sees."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(self.norm(h))
        return h @ self.tok.weight.T


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference_step(run: InBackwardLockStep, tokens: torch.Tensor, loss_fn=_loss) -> torch.Tensor:
    """torch's side: one step on ``tokens``; returns the loss its forward computed."""
    loss = loss_fn(run.ref(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    if run.max_grad_norm is not None:
        params = run.ref.module.parameters()
        run.ref_norm = float(torch.nn.utils.clip_grad_norm_(params, run.max_grad_norm))
    run.ref_opt.step()
    run.ref_opt.zero_grad()
    run.scheds[0].step()
    return loss.detach()


def _train(
    run: InBackwardLockStep, what: str, exact: bool, lags: bool, device: str = "cpu"
) -> list[int]:
    """STEPS steps of both (torch's one step ahead, so that ours' forward follows ours' last
    backward at once); returns the number of buckets still pending when ours' attention module
    was called, per forward from the third."""
    seen: list[int] = []
    core = run.ours._optimizer_core
    attn = run.ours.module.attn
    attn.register_forward_pre_hook(lambda m, a: seen.append(len(core.pending_steps())))
    core._delay_host_steps(DELAY)
    if exact:
        check = torch.equal
    elif device == "cpu":  # clipping: the coefficient's rounding (as in test_offload.py)
        check = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    else:  # torch's CUDA kernels against the host's
        check = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
    batches = [torch.randint(0, VOCAB, (4, SEQ + 1), device=device) for _ in range(STEPS)]
    ref_loss = _reference_step(run, batches[0])
    for step, tokens in enumerate(batches):
        loss = _loss(run.ours(tokens[:, :-1]), tokens[:, 1:])  # reads the last steps' weights
        assert not core.pending_steps(), f"{what} step {step}: forward left steps pending"
        assert check(loss, ref_loss), f"{what} step {step}: loss {loss.item()} {ref_loss.item()}"
        if step + 1 < STEPS:
            ref_loss = _reference_step(run, batches[step + 1])
        loss.backward()
        if lags and step > 0:  # (after the first backward the next forward rebuilds buckets)
            assert core.pending_steps(), f"{what} step {step}: the worker did not lag"
        run.scheds[1].step()
    for name, a, b in run.pairs():  # (state_dict() waits)
        assert check(a, b), f"{what} {name}: max diff {(a - b).abs().max().item()}"
    return seen[2:]  # (the second forward rebuilds the buckets: it waits for every step)


def _per_bucket(rank: int, world_size: int, device: str = "cpu") -> None:
    # (clipped: SGD, whose step is linear in the clipped gradient; Adam turns the coefficient's
    # last-bit rounding on rounding-noise gradients into visible differences)
    for clip, optimizer in ((None, "adamw"), (0.05, "sgd-nesterov")):
        run = InBackwardLockStep(
            ReadsOutsideOwners(rank).to(device), OPTIMIZERS[optimizer], offload=True,
            max_grad_norm=clip, bucket_cap_mb=0.2,
            device_ids=[0] if device == "cuda" else None,
        )  # fmt: skip
        what = f"{device} {optimizer} max_grad_norm={clip}"
        assert len(run.ours.reducer.bucket_indices()) >= 4, "one bucket: nothing to order"
        exact = clip is None and device == "cpu"
        seen = _train(run, what, exact=exact, lags=True, device=device)
        # The attention module's pre-hook runs after the forward waited for the buckets read
        # before it, the first layers' (stepped first): later buckets were still pending then.
        assert min(seen) > 0, f"{what}: the forward waited for every bucket at its start {seen}"
        stats = run.ours.offload_stats()
        assert stats["iterations"] == STEPS, stats


def test_forward_waits_per_bucket_and_reads_stepped_weights() -> None:
    run_ranks(2, _per_bucket)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_forward_waits_per_bucket_on_a_shared_gpu() -> None:
    """Two gloo ranks sharing GPU 0: each wait is the host's for the worker, then the current
    stream's for that bucket's copy back."""
    run_ranks(2, _per_bucket, "cuda")


COPY_LAG = 0.5  # seconds a copy back runs after the worker queued it (host ordering)
#: seconds the worker sleeps before each host step where a test polls pending_steps(): after
#: the first bucket's step, the next stays pending at least this long, poll and load included
PENDING_DELAY = 0.3


def _first_read_bucket(run: InBackwardLockStep) -> int:
    """The bucket of the token embedding, the first weight the forward reads."""
    index = [p is run.ours.module.tok.weight for p in run.ours._params].index(True)
    buckets = run.ours.reducer.bucket_indices()
    return next(b for b, members in enumerate(buckets) if index in members)


def _forward_at_the_first_bucket(
    run, what: str, device: str, loss_fn=_loss, after_backward=None
) -> int:
    """STEPS steps of both (an InBackwardLockStep or one with its interface), ours' forward
    started the moment the first-read bucket's host step is done (no longer in pending_steps(),
    a query that orders nothing) while later buckets are still pending: its loss must be
    torch's, bit for bit. ``after_backward()`` runs right after each of ours' backwards. Returns
    the steps that asked this."""
    core = run.ours._optimizer_core
    batches = [torch.randint(0, VOCAB, (4, SEQ + 1), device=device) for _ in range(STEPS)]
    ref_loss = _reference_step(run, batches[0], loss_fn)
    asked = 0
    for step, tokens in enumerate(batches):
        if step >= 2:  # (the second forward rebuilds the buckets: it waits for every step)
            first = _first_read_bucket(run)
            start = time.monotonic()
            while first in (pending := core.pending_steps()):
                assert time.monotonic() - start < 60, f"{what}: the worker never stepped {first}"
                time.sleep(0.001)
            asked += bool(pending)  # later buckets still pending: the per-bucket waits run
        loss = loss_fn(run.ours(tokens[:, :-1]), tokens[:, 1:])
        assert torch.equal(loss, ref_loss), f"{what} step {step}: {loss.item()} {ref_loss.item()}"
        if step + 1 < STEPS:
            ref_loss = _reference_step(run, batches[step + 1], loss_fn)
        loss.backward()
        if after_backward is not None:
            after_backward()
        run.scheds[1].step()
    for name, a, b in run.pairs():
        assert torch.equal(a, b), f"{what} {name}: max diff {(a - b).abs().max().item()}"
    return asked


def _copies_back_lag(rank: int, world_size: int) -> None:
    run = host_ordered(
        lambda: InBackwardLockStep(
            ReadsOutsideOwners(rank), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.2
        )
    )
    assert len(run.ours.reducer.bucket_indices()) >= 4, "one bucket: nothing to order"
    run.ours._optimizer_core._delay_host_steps(PENDING_DELAY)  # later buckets stay pending a while
    run.ours._optimizer_core._delay_copies_back(COPY_LAG)  # each copy back lands COPY_LAG s later
    asked = _forward_at_the_first_bucket(run, "copies back lagging", "cpu")
    assert asked == STEPS - 2, f"later buckets were not pending in {STEPS - 2 - asked} steps"
    run.ours._optimizer_core._delay_copies_back(0)


def test_a_forward_waits_for_copies_back_of_buckets_not_pending() -> None:
    """Host ordering (csrc/streams.h), its host-to-device stream lagging: a bucket leaves
    pending_steps() when the worker stepped it and queued its copy back, which then still
    runs. The forward started at that moment reads that bucket first (the token embedding):
    it must be ordered after the copies back already queued, not only after the pending
    buckets' (a stale read changes the loss)."""
    run_ranks(2, _copies_back_lag)


class _BigEmbedding(nn.Module):
    """A 256 MiB token embedding (its own bucket, the first the forward reads and the first the
    worker steps) under a few layers of a bucket each: its copy back takes a while."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(64 * 1024, 1024)
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))
        self.head = nn.Linear(1024, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class _HostStepped:
    """torch's optimizer stepping float32 host copies of ``params`` (what offload_to_cpu's host
    kernel equals bit for bit: torch's fused CPU AdamW), the results copied back."""

    def __init__(self, params: list[nn.Parameter], factory) -> None:
        self.params = params
        self.masters = [p.detach().cpu().clone() for p in params]
        self.inner = reference_optimizer(factory, self.masters)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.cpu()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _GpuRun:
    """InBackwardLockStep's interface on one GPU: torch's DDP + _HostStepped against leanddp
    with offload_to_cpu, each with its LR scheduler (torch's on _HostStepped's host optimizer)."""

    def __init__(self, model: nn.Module) -> None:
        factory = OPTIMIZERS["adamw"]
        self.ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), device_ids=[0], process_group=dist.new_group()
        )
        self.ref_opt = _HostStepped(list(self.ref.module.parameters()), factory)
        self.ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model), device_ids=[0], process_group=dist.new_group(),
            bucket_cap_mb=4, optimizer_in_backward=factory, offload_to_cpu=True,
        )  # fmt: skip
        self.scheds = [scheduler(self.ref_opt.inner), scheduler(self.ours.optimizer)]
        self.max_grad_norm = None

    def pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        ours = self.ours.module.state_dict(keep_vars=True)
        return [(name, a, ours[name]) for name, a in self.ref.module.named_parameters()]


_COPY_LAG_CYCLES = 1_000_000_000  # GPU cycles (~0.5 s) queued on the copy-back stream


def _square_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.square().mean()  # (NLLLoss has no deterministic CUDA kernel)


def _cuda_first_bucket(rank: int, world_size: int) -> None:
    # bitwise repeatable CUDA kernels: the embedding's backward, cuBLAS (before its first use)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    run = _GpuRun(_BigEmbedding().cuda())
    run.ours._optimizer_core._delay_host_steps(PENDING_DELAY)  # later buckets stay pending a while
    stream_id, index, kind = run.ours._optimizer_core._copy_back_stream()
    copies_back = torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)

    def lag() -> None:  # the copies back wait behind this, as behind a busy PCIe link
        with torch.cuda.stream(copies_back):
            torch.cuda._sleep(_COPY_LAG_CYCLES)

    asked = _forward_at_the_first_bucket(
        run, "256 MiB embedding", "cuda", _square_loss, after_backward=lag
    )
    assert asked == STEPS - 2, f"later buckets were not pending in {STEPS - 2 - asked} steps"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_forward_reads_the_copied_back_embedding() -> None:
    """NCCL at world size 1: the forward starts the moment the 256 MiB embedding's host step is
    done, its copy back to the GPU just queued (behind a sleep on the copy stream, so that it
    is certainly still running). The loss must be that of torch's DDP + torch's fused AdamW on
    the host, bit for bit, at every step."""
    run_ranks(1, _cuda_first_bucket, backend="nccl")


def _dropped_steps(rank: int, world_size: int, how: str) -> None:
    torch.manual_seed(7)
    ddp = leanddp.DistributedDataParallel(
        Tower(), process_group=dist.new_group(), bucket_cap_mb=0.0005,  # a bucket per layer
        optimizer_in_backward=ADAMW, offload_to_cpu=True,
        check_for_nan_in_grad=how != "host step error",  # (holds the steps to the end)
    )  # fmt: skip
    x = torch.randn(8, 16)
    for _ in range(3):  # (the second forward rebuilds the buckets)
        ddp(x).square().mean().backward()
    assert len(ddp.reducer.bucket_indices()) == 4
    if how == "NaN":  # the NaN check drops this backward's host steps
        with nan_gradients(), pytest.raises(RuntimeError, match="check_for_nan_in_grad"):
            ddp(x).square().mean().backward()
    else:  # the host kernel rejects the first step: it and the rest are dropped
        group = ddp.optimizer.param_groups[0]
        good, group["betas"] = group["betas"], (1.5, 0.999)
        ddp(x).square().mean().backward()
        group["betas"] = good
        with pytest.raises(ValueError, match="beta1 must be in"):
            ddp(x)  # (raised once; the pipeline works again)
    ddp.synchronize()  # (the worker winds the failed iteration up: not what is measured)
    ddp._optimizer_core._delay_host_steps(DELAY * 4)  # each addition of the next micro-batch lags
    for i in range(3):
        with ddp.no_sync():
            before = ddp.offload_stats()["wait_seconds"]
            start = time.perf_counter()
            out = ddp(x)
            took = time.perf_counter() - start
            waited = ddp.offload_stats()["wait_seconds"] - before
            what = f"{how}, micro-batch {i}: waited {waited} s, took {took} s"
            # the worker sums the last micro-batch; no step is pending, dropped or not
            assert waited == 0 and took < DELAY * 2, what
            assert not ddp._optimizer_core.pending_steps(), what
            out.square().mean().backward()
    ddp._optimizer_core._delay_host_steps(0)
    ddp(x).square().mean().backward()  # the step trains on
    ddp.synchronize()
    assert ddp.offload_stats()["iterations"] == 4


@pytest.mark.parametrize("how", ["NaN", "host step error", "held host step error"])
def test_dropped_host_steps_are_not_pending(how: str) -> None:
    """offload_to_cpu: a backward whose host steps are dropped (the NaN check found NaN in the
    reduced gradients; the worker's step failed, one at a time or among steps the NaN check
    held to the end of backward). The forwards after it do not wait for them while the worker
    sums no_sync() micro-batches (each addition delayed): they are not pending."""
    run_ranks(2, _dropped_steps, how)


def _sharded(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(
        ReadsOutsideOwners(rank), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.2,
        ours_kwargs=dict(shard_optimizer_state=True),
    )  # fmt: skip
    seen = _train(run, "sharded", exact=True, lags=False)  # gathered at the end of backward
    assert max(seen) == 0, seen


def test_sharded_offload_gathers_before_the_forward() -> None:
    run_ranks(2, _sharded)


def _compiled_part(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(
        ReadsOutsideOwners(rank), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.2
    )
    run.ours.module.mlp.compile(backend="eager")  # its reads are not seen one by one
    seen = _train(run, "compiled mlp", exact=True, lags=True)
    assert max(seen) == 0, f"the forward did not wait for everything at its start: {seen}"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_compiled_submodule_waits_for_everything_first() -> None:
    run_ranks(2, _compiled_part)


class WithBuffer(ReadsOutsideOwners):
    """A buffer: the wrapper broadcasts it from rank 0 at each forward (a collective there)."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.register_buffer("count", torch.zeros(1))


def _error_on_both(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(WithBuffer(rank), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.2)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(2):  # (the second forward rebuilds the buckets)
        _loss(run.ours(x), y).backward()
    good = run.ours.optimizer.param_groups[0]["betas"]
    run.ours.optimizer.param_groups[0]["betas"] = (1.5, 0.999)  # the host kernel rejects it
    run.ours._optimizer_core._delay_host_steps(DELAY if rank == 0 else 0)
    _loss(run.ours(x), y).backward()
    if rank == 1:  # rank 1's worker failed before its forward, rank 0's is still asleep then
        while run.ours._optimizer_core.pending_steps():
            time.sleep(0.001)
    else:
        assert run.ours._optimizer_core.pending_steps()
    with pytest.raises(ValueError, match="beta1 must be in"):
        run.ours(x)
    run.ours._optimizer_core._delay_host_steps(0)
    run.ours.optimizer.param_groups[0]["betas"] = good
    _loss(run.ours(x), y).backward()  # the pipeline works again, on both ranks
    run.ours.synchronize()
    assert run.ours.offload_stats()["iterations"] == 3


def test_a_host_step_error_raises_on_every_rank_at_the_same_point() -> None:
    """One rank finds the worker's error at the forward's start, the other while it waits per
    bucket: both raise it when the module returns, after the forward's buffer broadcast, so
    neither is left alone in it (it would hang)."""
    run_ranks(2, _error_on_both)

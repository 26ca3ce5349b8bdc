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

import time

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep
from torch import nn

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


def _reference_step(run: InBackwardLockStep, tokens: torch.Tensor) -> torch.Tensor:
    """torch's side: one step on ``tokens``; returns the loss its forward computed."""
    loss = _loss(run.ref(tokens[:, :-1]), tokens[:, 1:])
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
    reducer = run.ours.reducer
    attn = run.ours.module.attn
    attn.register_forward_pre_hook(lambda m, a: seen.append(len(reducer.pending_steps())))
    reducer._delay_host_steps(DELAY)
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
        assert not reducer.pending_steps(), f"{what} step {step}: forward left steps pending"
        assert check(loss, ref_loss), f"{what} step {step}: loss {loss.item()} {ref_loss.item()}"
        if step + 1 < STEPS:
            ref_loss = _reference_step(run, batches[step + 1])
        loss.backward()
        if lags and step > 0:  # (after the first backward the next forward rebuilds buckets)
            assert reducer.pending_steps(), f"{what} step {step}: the worker did not lag"
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
    run.ours.reducer._delay_host_steps(DELAY if rank == 0 else 0)
    _loss(run.ours(x), y).backward()
    if rank == 1:  # rank 1's worker failed before its forward, rank 0's is still asleep then
        while run.ours.reducer.pending_steps():
            time.sleep(0.001)
    else:
        assert run.ours.reducer.pending_steps()
    with pytest.raises(ValueError, match="beta1 must be in"):
        run.ours(x)
    run.ours.reducer._delay_host_steps(0)
    run.ours.optimizer.param_groups[0]["betas"] = good
    _loss(run.ours(x), y).backward()  # the pipeline works again, on both ranks
    run.ours.synchronize()
    assert run.ours.offload_stats()["iterations"] == 3


def test_a_host_step_error_raises_on_every_rank_at_the_same_point() -> None:
    """One rank finds the worker's error at the forward's start, the other while it waits per
    bucket: both raise it when the module returns, after the forward's buffer broadcast, so
    neither is left alone in it (it would hang)."""
    run_ranks(2, _error_on_both)

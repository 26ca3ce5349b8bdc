"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) against torch's DDP, run in
the same processes on the same random data: a bucket of its own per sparse parameter, the sparse
gradient averaged with the process group's sparse allreduce and left in param.grad as a sparse
tensor equal to torch's, dense gradients still bucket views; no_sync accumulation, views off,
tiny buckets, a static graph, a comm hook. Where torch's DDP raises (a sparse parameter unused
on a rank under find_unused_parameters: "Expected sparse gradient to be defined"), leanddp is
compared with torch's DDP over the same model with dense embeddings. Then the errors: what
optimizer_in_backward refuses at construction, a sparse gradient where none is expected, and a
comm hook that cannot handle a sparse bucket. Last, benchmarks/gloo_sparse_stress.py briefly.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from sparse_models import BATCH, DIM, VOCAB, SparseCase, SparseNet, sparse_parity_case
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp

CASES = [
    SparseCase(),
    SparseCase(accum=3),
    SparseCase(views=False, accum=2),
    SparseCase(tiny_buckets=True, accum=2),
    SparseCase(static_graph=True),
    SparseCase(find_unused=True, accum=2),
    SparseCase(comm_hook=True, accum=2),
    SparseCase(nan_check=True, tiny_buckets=True),
    # torch's DDP raises here: compared against torch's DDP over dense embeddings
    SparseCase(find_unused=True, emb_users={1: (), 2: (0,), 3: (1,)}),
    SparseCase(find_unused=True, accum=2, views=False, emb_users={0: (0,), 2: ()}),
]


def _parity(rank: int, world_size: int) -> None:
    for case in CASES:
        sparse_parity_case(rank, world_size, case)
    _errors(rank, world_size)


class _FunctionalSparse(nn.Module):
    """Sparse gradients from F.embedding: torch's DDP does not expect them (not an Embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM))
        self.lin = nn.Linear(DIM, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(F.embedding(idx, self.table, sparse=True)).sum()


def _flat_only_hook(state, bucket):  # (string annotations would fail torch's hook check)
    bucket.buffer().view(-1)  # what a hook written for flat buffers may do: raises on sparse
    return default_hooks.allreduce_hook(state, bucket)


def _dense_result_hook(state, bucket):
    if not bucket.buffer().is_sparse:
        return default_hooks.allreduce_hook(state, bucket)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer().to_dense())  # a dense result for a sparse bucket
    return future


def _errors(rank: int, world_size: int) -> None:
    idx = torch.randint(0, VOCAB, (BATCH, 3))
    ddp = leanddp.DistributedDataParallel(_FunctionalSparse(), process_group=dist.new_group())
    with pytest.raises(RuntimeError, match="parameter table received a sparse gradient"):
        ddp(idx).backward()
    ddp = leanddp.DistributedDataParallel(SparseNet(), process_group=dist.new_group())
    ddp.register_comm_hook(ddp.process_group, _flat_only_hook)
    with pytest.raises(RuntimeError, match="communication hook failed on the sparse gradient of"):
        ddp(idx, torch.randn(BATCH, DIM)).sum().backward()
    ddp = leanddp.DistributedDataParallel(SparseNet(), process_group=dist.new_group())
    ddp.register_comm_hook(ddp.process_group, _dense_result_hook)
    with pytest.raises(
        RuntimeError, match=r"returned .* for the sparse gradient of (emb|bag)\.weight"
    ):
        ddp(idx, torch.randn(BATCH, DIM)).sum().backward()


def test_sparse_gradients_match_torch_ddp() -> None:
    run_ranks(2, _parity)


@pytest.mark.parametrize("offload", [False, True])
def test_optimizer_in_backward_refuses_sparse_parameters(offload: bool) -> None:
    module = SparseNet()
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(ValueError, match="parameter 'emb.weight' gets sparse gradients") as info:
        leanddp.DistributedDataParallel(
            module,
            optimizer_in_backward=functools.partial(torch.optim.SGD, lr=0.1),
            offload_to_cpu=offload,
        )
    assert ("offload_to_cpu" in str(info.value)) == offload
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in module.parameters())


class _Late:
    """A comm hook's state: its futures complete ``delay`` seconds after the call (the local
    bucket as the result); it records, at each call, which earlier futures were complete."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.futures: list[torch.futures.Future] = []
        self.calls: list[tuple[bool, list[bool]]] = []  # (sparse, done flags of earlier ones)


def _late_hook(state, bucket):  # (string annotations would fail torch's hook check)
    buffer = bucket.buffer()
    state.calls.append((buffer.is_sparse, [f.done() for f in state.futures]))
    future: torch.futures.Future = torch.futures.Future()
    state.futures.append(future)
    threading.Timer(state.delay, future.set_result, args=(buffer,)).start()
    return future


def _sparse_alone(rank: int, world_size: int) -> None:
    late = _Late(delay=0.3)
    ddp = leanddp.DistributedDataParallel(
        SparseNet(), process_group=dist.new_group(), bucket_cap_mb=0.00001
    )
    ddp.register_comm_hook(late, _late_hook)
    for step in range(3):
        late.futures.clear()
        late.calls.clear()
        ddp(torch.randint(0, VOCAB, (BATCH, 3)), torch.randn(BATCH, DIM)).sum().backward()
        kinds = [sparse for sparse, _ in late.calls]
        for i, (sparse, done) in enumerate(late.calls):
            for j, finished in enumerate(done):
                if sparse or kinds[j]:  # a sparse reduction runs alone
                    assert finished, f"step {step}: bucket {i} launched before {j} completed"
        if step == 0:
            continue  # buckets in the order gradients arrived from step 1 (the rebuild)
        assert kinds == [False, False, True, True, False, False], f"step {step}: {kinds}"
        # dense reductions still overlap: some dense launch found an earlier one running
        assert any(not all(done) for sparse, done in late.calls if not sparse), (
            f"step {step}: dense reductions did not overlap: {late.calls}"
        )


def test_sparse_reduction_runs_alone_on_the_process_group() -> None:
    """gloo's sparse allreduce beside another collective of its group corrupts memory (see
    csrc/reducer_sparse.cpp): a sparse bucket is launched only once every earlier reduction
    completed, and the next only once it completed, while dense reductions still overlap."""
    run_ranks(2, _sparse_alone)


def _sparse_on_one_rank(rank: int, world_size: int) -> None:
    module = SparseNet()
    if rank == 1:
        module.emb.sparse = False  # the same parameters, dense gradients on this rank only
    with pytest.raises(
        ValueError,
        match=r"parameter #2 is 'emb.weight' \[30, 6\] torch.float32 with sparse gradients on "
        r"rank 0 but 'emb.weight' \[30, 6\] torch.float32 with dense gradients on rank 1\. "
        r"Build the module with the same sparse= on every rank",
    ):
        leanddp.DistributedDataParallel(module)
    # every rank raised after the same collectives: the next one matches across ranks
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    assert value.item() == world_size * (world_size + 1) / 2


def test_sparse_on_some_ranks_only_raises_at_construction() -> None:
    """A module built with sparse=True on some ranks only: every rank raises at construction,
    naming the parameter. (torch's DDP 2.14 does not compare the kind of gradient: it
    constructs, and its first backward runs a sparse allreduce on one rank against a dense
    one on the other, which gloo aborts the process on.)"""
    run_ranks(2, _sparse_on_one_rank)


@pytest.mark.parametrize("ddp", ["torch", "leanddp"])
def test_the_gloo_stress_script_runs(ddp: str) -> None:
    # benchmarks/gloo_sparse_stress.py, briefly: torch's DDP on a one-thread gloo group (the
    # reference above), leanddp's on torch's default two threads
    threads = "1" if ddp == "torch" else "2"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gloo_sparse_stress.py"
    args = f"--ddp {ddp} --threads {threads} --steps 30 --runs 1".split()
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run 1/1: finished" in done.stdout
    assert f"{ddp}'s DDP, gloo threads {threads}, 30 steps: 0 of 1 runs died" in done.stdout

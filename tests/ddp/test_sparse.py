"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) against torch's DDP, run in
the same processes on the same random data: a bucket of its own per sparse parameter, the sparse
gradient averaged with the process group's sparse allreduce and left in param.grad as a sparse
tensor equal to torch's, dense gradients still bucket views; no_sync accumulation, views off,
tiny buckets, a static graph, a comm hook. Where torch's DDP raises (a sparse parameter unused
on a rank under find_unused_parameters: "Expected sparse gradient to be defined"), leanddp is
compared with torch's DDP over the same model with dense embeddings. Then the errors: what
optimizer_in_backward refuses at construction, a sparse gradient where none is expected, and a
comm hook that cannot handle a sparse bucket.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp

VOCAB, DIM, BATCH, STEPS = 30, 6, 8, 5
SPARSE = ("emb.weight", "bag.weight")


class SparseNet(nn.Module):
    """Dense layers around an nn.Embedding and an nn.EmbeddingBag (sparse unless ``dense``).
    ``use_emb`` switches the embedding off for a forward (find_unused_parameters)."""

    def __init__(self, dense: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=not dense)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=not dense)
        self.head = nn.Linear(DIM, 3)
        self.use_emb = True

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) + self.bag(idx)
        if self.use_emb:
            h = h + self.emb(idx).sum(1)
        return self.head(h)


@dataclasses.dataclass
class Case:
    views: bool = True
    accum: int = 1
    tiny_buckets: bool = False
    static_graph: bool = False
    find_unused: bool = False
    comm_hook: bool = False
    nan_check: bool = False
    # step -> ranks that use the embedding (find_unused); missing: every rank
    emb_users: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def kwargs(self) -> dict:
        return dict(
            gradient_as_bucket_view=self.views,
            bucket_cap_mb=0.0002 if self.tiny_buckets else None,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused,
        )


CASES = [
    Case(),
    Case(accum=3),
    Case(views=False, accum=2),
    Case(tiny_buckets=True, accum=2),
    Case(static_graph=True),
    Case(find_unused=True, accum=2),
    Case(comm_hook=True, accum=2),
    Case(nan_check=True, tiny_buckets=True),
    # torch's DDP raises here: compared against torch's DDP over dense embeddings
    Case(find_unused=True, emb_users={1: (), 2: (0,), 3: (1,)}),
    Case(find_unused=True, accum=2, views=False, emb_users={0: (0,), 2: ()}),
]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD (which takes sparse gradients): momentum on the dense layers, plain on embeddings."""
    dense = [p for n, p in model.named_parameters() if n.split(".")[0] in ("lin", "head")]
    sparse = [p for n, p in model.named_parameters() if n.split(".")[0] in ("emb", "bag")]
    return torch.optim.SGD([dict(params=dense, momentum=0.9), dict(params=sparse)], lr=0.1)


def _train(ddp: nn.Module, batches: list, users: tuple[int, ...], rank: int) -> None:
    """One step's micro-batches, all but the last under no_sync."""
    ddp.module.use_emb = rank in users
    for i, (idx, x) in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                ddp(idx, x).square().mean().backward()
        else:
            ddp(idx, x).square().mean().backward()


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else (t.to_dense() if t.is_sparse else t)


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Against the dense twin: its embedding gradients are summed in another order, so the
    parameters drift apart by rounding (a few ulps) over the steps, never by more."""
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _check_grads(ref: nn.Module, ours: nn.Module, exact: bool, what: str) -> None:
    for (name, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), f"{what} {name}: {a.grad} vs {b.grad}"
        if b.grad is None:
            continue
        if name in SPARSE:
            assert b.grad.is_sparse, f"{what} {name}: leanddp's gradient is {b.grad.layout}"
        if exact:
            assert a.grad.is_sparse == b.grad.is_sparse, f"{what} {name}: layouts differ"
            if b.grad.is_sparse:
                ca, cb = a.grad.coalesce(), b.grad.coalesce()
                assert torch.equal(ca.indices(), cb.indices()), f"{what} {name}: indices"
                assert torch.equal(ca.values(), cb.values()), f"{what} {name}: values"
            else:
                assert torch.equal(a.grad, b.grad), f"{what} {name}: grads differ"
        else:
            _close(_dense(b.grad), _dense(a.grad), f"{what} {name} grad")


def _parity_case(rank: int, world_size: int, case: Case) -> None:
    # torch's DDP cannot reduce a sparse parameter a rank did not use: its twin has dense ones
    twin = bool(case.emb_users)
    model = SparseNet()  # different initial weights on every rank (broadcast from rank 0)
    ref_model = copy.deepcopy(model)
    if twin:
        ref_model = SparseNet(dense=True)
        ref_model.load_state_dict(model.state_dict())
    ref = torch.nn.parallel.DistributedDataParallel(
        ref_model, process_group=dist.new_group(), **case.kwargs()
    )
    ours = leanddp.DistributedDataParallel(
        copy.deepcopy(model),
        process_group=dist.new_group(),
        check_for_nan_in_grad=case.nan_check,
        **case.kwargs(),
    )
    if case.comm_hook:
        for ddp in (ref, ours):
            ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
    opts = [_sgd(ref.module), _sgd(ours.module)]
    sparse_idx = [i for i, (n, _) in enumerate(ours.module.named_parameters()) if n in SPARSE]
    for step in range(STEPS):
        accum = 1 if case.static_graph and step == 0 else case.accum
        batches = [
            (torch.randint(0, VOCAB, (BATCH, 3)), torch.randn(BATCH, DIM)) for _ in range(accum)
        ]
        users = case.emb_users.get(step, tuple(range(world_size)))
        what = f"{case} step {step}"
        for ddp, opt in zip((ref, ours), opts, strict=True):
            opt.zero_grad(set_to_none=step % 2 == 0)
            try:
                _train(ddp, batches, users, rank)
            except Exception as exc:
                raise AssertionError(f"{what}: backward of {type(ddp).__module__} failed") from exc
        _check_grads(ref.module, ours.module, not twin, what)
        if not users and step % 2 == 0:
            assert ours.module.emb.weight.grad is None, f"{what}: globally unused got a grad"
        # every sparse parameter in a bucket of its own, the same layout on every rank
        buckets = ours.reducer.bucket_indices()
        for i in sparse_idx:
            assert [i] in buckets, f"{what}: sparse parameter {i} shares a bucket: {buckets}"
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, buckets)
        assert all(b == buckets for b in everyone), f"{what}: bucket layouts differ {everyone}"
        stats = ours.memory_stats()
        with_grad = [p for p in ours.module.parameters() if p.grad is not None]
        sparse_grads = sum(p.grad.is_sparse for p in with_grad)
        if case.views:
            assert stats["grads_as_views"] == len(with_grad) - sparse_grads, f"{what}: {stats}"
        assert stats["grads_outside"] == (len(with_grad) if not case.views else sparse_grads)
        for opt in opts:
            opt.step()
        for (name, a), b in zip(
            ref.module.named_parameters(), ours.module.parameters(), strict=True
        ):
            if twin:
                _close(b, a, f"{what} {name}")
            else:
                assert torch.equal(a, b), f"{what} {name}: max diff {(a - b).abs().max()}"


def _parity(rank: int, world_size: int) -> None:
    for case in CASES:
        _parity_case(rank, world_size, case)
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

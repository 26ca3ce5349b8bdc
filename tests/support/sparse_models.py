"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) against torch's DDP: the
model, the configurations compared (SparseCase) and one configuration's run, leanddp beside
torch's DDP in the same processes (test_sparse.py, and under host ordering
test_host_ordering.py)."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
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
class SparseCase:
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


#: How many gloo_group()s this process made (the store prefix of the next, the same on every
#: rank since all make them in the same order).
_gloo_groups = 0


def gloo_group(threads: int = 1) -> dist.ProcessGroup:
    """A gloo group of every rank whose collectives run on ``threads`` worker threads (torch's
    default is 2). With one, it runs one collective at a time: the group of torch's DDP beside
    leanddp here. torch's reducer lets a sparse bucket's allreduce run beside its dense buckets'
    and its unused-parameter map's, and gloo's sparse allreduce beside another collective of its
    group corrupts the heap now and then: the rank dies with SIGSEGV or
    "malloc(): unaligned tcache chunk detected" (torch 2.14.1, torch's DDP alone over SparseNet
    on 2 ranks: 3 of 11 runs of 3000 steps died; with one thread, none of 15;
    benchmarks/gloo_sparse_stress.py). leanddp reduces a sparse bucket alone on its group
    (csrc/reducer_sparse.cpp; none of 5 such runs died) and is given a plain group."""
    global _gloo_groups
    _gloo_groups += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore(
        f"gloo_group{_gloo_groups}", dist.distributed_c10d._get_default_store()
    )
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = threads
    gloo = dist.ProcessGroupGloo(store, rank, world, options)
    group = dist.ProcessGroup(store, rank, world)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


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


def sparse_parity_case(rank: int, world_size: int, case: SparseCase) -> None:
    """SparseNet under ``case``, leanddp against torch's DDP (against its dense twin where
    ``case.emb_users`` leaves a sparse parameter unused on a rank) over STEPS steps: gradients
    bitwise (the twin's within rounding), every sparse parameter in a bucket of its own, the
    same buckets on every rank, the gradients counted as views or outside, the weights after
    each step."""
    # torch's DDP cannot reduce a sparse parameter a rank did not use: its twin has dense ones
    twin = bool(case.emb_users)
    model = SparseNet()  # different initial weights on every rank (broadcast from rank 0)
    ref_model = copy.deepcopy(model)
    if twin:
        ref_model = SparseNet(dense=True)
        ref_model.load_state_dict(model.state_dict())
    ref = torch.nn.parallel.DistributedDataParallel(
        ref_model, process_group=gloo_group(), **case.kwargs()
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

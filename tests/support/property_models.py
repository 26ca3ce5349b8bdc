"""Random models for tests/ddp/test_properties.py, described by a picklable :class:`Spec`, and
the per-rank body of one example: torch's DDP + a torch optimizer against leanddp (with the same
optimizer, or ``optimizer_in_backward``), in lock step on the same data, compared after every
step.

A model is a trunk of blocks (Linear, Conv1d, LayerNorm, BatchNorm1d, Embedding, each in its own
dtype, optionally frozen, with a buffer, or with its weight tied to an earlier Linear's) and of
residual branches that every rank, no rank, only rank 0, or every rank on odd forwards only
uses; a float32 head makes the loss. The input is a float tensor ``(batch, seq, width)`` and
token ids ``(batch, seq)`` for the Embeddings.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from in_backward_models import reference_optimizer
from torch import nn

import leanddp

VOCAB = 7
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "sgd-nesterov": functools.partial(
        torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
}


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str  # linear | conv | layernorm | batchnorm | embed
    width: int  # output width (norms and embeddings keep their input width)
    dtype: str = "float32"
    frozen: bool = False
    affine: bool = True  # bias of linear/conv, affine parameters of the norms
    kernel: int = 1  # conv
    tie: int = -1  # linear: the block index (in build order) whose weight this one shares
    buffer: bool = False  # a constant per-channel scale, registered as a buffer


@dataclasses.dataclass(frozen=True)
class Branch:
    blocks: tuple[Block, ...]  # the last returns to the branch's input width
    use: str  # all | none (no rank) | rank0 (only rank 0) | odd (odd forwards, every rank)


@dataclasses.dataclass(frozen=True)
class Spec:
    seed: int
    in_width: int
    items: tuple[Block | Branch, ...]
    batch: int = 2
    seq: int = 1
    steps: int = 2
    accum: int = 1
    bucket_cap_mb: float | None = None
    views: bool = True
    find_unused: bool = False
    static_graph: bool = False
    optimizer: str = "sgd"
    in_backward: bool = False
    offload: bool = False
    scheduler: bool = False
    set_to_none: bool = True  # zero_grad's argument (without optimizer_in_backward)
    legacy_calls: bool = False  # with optimizer_in_backward: also call the no-op step/zero_grad

    def ddp_kwargs(self) -> dict:
        return dict(
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.views,
            find_unused_parameters=self.find_unused,
            static_graph=self.static_graph,
        )


class BlockModule(nn.Module):
    def __init__(self, block: Block, width_in: int) -> None:
        super().__init__()
        self.kind = block.kind
        self.dtype = DTYPES[block.dtype]
        if block.kind == "linear":
            self.layer = nn.Linear(width_in, block.width, bias=block.affine)
        elif block.kind == "conv":
            pad = block.kernel // 2
            self.layer = nn.Conv1d(
                width_in, block.width, block.kernel, padding=pad, bias=block.affine
            )
        elif block.kind == "layernorm":
            self.layer = nn.LayerNorm(width_in, elementwise_affine=block.affine)
        elif block.kind == "batchnorm":
            self.layer = nn.BatchNorm1d(width_in, affine=block.affine)
        else:
            self.layer = nn.Embedding(VOCAB, width_in)
        if block.buffer:
            self.register_buffer("scale", torch.rand(block.width) + 0.5)
        else:
            self.scale = None
        self.to(self.dtype)
        if block.frozen:
            self.requires_grad_(False)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = h.to(self.dtype)
        if self.kind == "linear":
            y = torch.tanh(self.layer(h))
        elif self.kind == "conv":
            y = torch.tanh(self.layer(h.transpose(1, 2)).transpose(1, 2))
        elif self.kind == "layernorm":
            y = self.layer(h)
        elif self.kind == "batchnorm":
            y = self.layer(h.transpose(1, 2)).transpose(1, 2)
        else:
            y = h + self.layer(ids)
        return y if self.scale is None else y * self.scale


class BranchModule(nn.Module):
    def __init__(self, blocks: list[BlockModule], use: str, rank: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.use = use
        self.rank = rank

    def active(self, it: int) -> bool:
        return {"all": True, "none": False, "rank0": self.rank == 0, "odd": it % 2 == 1}[self.use]

    def forward(self, h: torch.Tensor, ids: torch.Tensor, it: int) -> torch.Tensor:
        if not self.active(it):
            return h
        y = h
        for block in self.blocks:
            y = block(y, ids)
        return h + y.to(h.dtype)


class PropNet(nn.Module):
    """The model a Spec describes (rank decides which branches this rank runs)."""

    def __init__(self, spec: Spec, rank: int) -> None:
        super().__init__()
        flat: list[BlockModule] = []
        items: list[nn.Module] = []
        width = spec.in_width
        for item in spec.items:
            if isinstance(item, Block):
                flat.append(BlockModule(item, width))
                items.append(flat[-1])
                width = item.width
            else:
                blocks, w = [], width
                for block in item.blocks:
                    blocks.append(BlockModule(block, w))
                    w = block.width
                assert w == width, "a branch must return to its input width"
                flat += blocks
                items.append(BranchModule(blocks, item.use, rank))
        self.items = nn.ModuleList(items)
        self.head = nn.Linear(width, 2)
        tied = [(i, b) for i, b in enumerate(_flat_blocks(spec)) if b.tie >= 0]
        for i, block in tied:
            flat[i].layer.weight = flat[block.tie].layer.weight

    def forward(self, x: torch.Tensor, ids: torch.Tensor, it: int) -> torch.Tensor:
        h = x
        for item in self.items:
            h = item(h, ids, it) if isinstance(item, BranchModule) else item(h, ids)
        return self.head(h.float())


def _flat_blocks(spec: Spec) -> list[Block]:
    out: list[Block] = []
    for item in spec.items:
        out += [item] if isinstance(item, Block) else list(item.blocks)
    return out


# ------------------------------------------------------------------------------------------
# one example, on one rank


def _forward_backward(ddp: nn.Module, batches: list, first_it: int) -> None:
    """Forward and backward over ``batches``, all but the last under ``ddp.no_sync()``."""
    for i, (x, ids) in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                ddp(x, ids, first_it + i).square().mean().backward()
        else:
            ddp(x, ids, first_it + i).square().mean().backward()


#: optimizer_in_backward: how far one step of leanddp's fused kernels may be from the same
#: step of torch's optimizer, both from the same parameters, state and (bitwise equal)
#: gradients (torch's side is re-synchronized after every step, see _resync). The kernels
#: evaluate the same formulas in another order, so a result may be off by a few float32
#: roundings (6e-8 relative each) of the parameter and of the terms of its update: within
#: STEP_RTOL of the value plus STEP_ATOL of the largest update (or moment) in the tensor, i.e.
#: 16 roundings of each. (Measured over 150 random examples: at most 0.8 of a rounding of
#: the largest update beyond 1e-6 of the value.) bfloat16/float16 parameters are stepped by
#: the kernels in float32 math with one rounding to the dtype, where torch's (unfused)
#: optimizers round after each operation: four units in the last place of the dtype. Other
#: dtypes (float64) are stepped by a per-bucket instance of torch's optimizer class
#: (leanddp/optim/_fallback.py), built as the user built it: its for-loop implementation on
#: the CPU. Against torch's for-loop optimizer that is bitwise equal; against its fused kernel,
#: which reference_optimizer picks for Adam(W), the same formulas are rounded otherwise, a few
#: float64 roundings apart (FALLBACK_VS_FUSED_TOL, 4500 of them, in the same terms).
STEP_RTOL = STEP_ATOL = 1e-6
LOW_PRECISION_TOL = {torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}
FALLBACK_VS_FUSED_TOL = 1e-12


def _step_tol(spec: Spec, ref_opt: torch.optim.Optimizer, p: torch.Tensor) -> float | None:
    """How far one in-backward step of ``p`` (and its state) may be from torch's, relative to
    the value and to the largest update (or state value) in the tensor; None: bitwise."""
    if not spec.in_backward:
        return None
    if p.dtype in (torch.float32, *LOW_PRECISION_TOL):  # leanddp's kernels
        return LOW_PRECISION_TOL.get(p.dtype, STEP_RTOL)
    fused_reference = any(group.get("fused") for group in ref_opt.param_groups)
    return FALLBACK_VS_FUSED_TOL if fused_reference else None


def _compare(
    a: torch.Tensor | None, b: torch.Tensor | None, what: str, tol: float | None, scale: float = 0.0
) -> None:
    """torch's ``a`` against leanddp's ``b``: bitwise (``tol`` None), else within ``tol``
    relative and ``tol * scale`` absolute."""
    assert (a is None) == (b is None), f"{what}: torch has {'None' if a is None else 'a tensor'}"
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
    )
    if tol is None:
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{what}: not bitwise equal, max abs difference {diff}")
    else:
        torch.testing.assert_close(b, a, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _compare_state(spec: Spec, ref_opt, our_opt, pairs, what: str) -> None:
    """Which parameters have optimizer state, its keys and step counts (exactly), and its
    tensors (see STEP_RTOL)."""
    for name, a, b in pairs:
        want, got = ref_opt.state.get(a), our_opt.state.get(b)
        assert (want is None) == (got is None), f"{what} state of {name}: torch {want}, ours {got}"
        if want is None:
            continue
        assert set(got) == set(want), f"{what} state keys of {name}: {sorted(got)} {sorted(want)}"
        for key, value in want.items():
            if key == "step":
                assert float(got[key]) == float(value), f"{what} {name} step: {got[key]} {value}"
            else:
                tol, scale = _step_tol(spec, ref_opt, a), value.abs().max().item()
                _compare(value, got[key], f"{what} {key} of {name}", tol, scale)


@torch.no_grad()
def _resync(ref_opt, our_opt, pairs) -> None:
    """Sets torch's parameters and optimizer state to leanddp's (just compared, so equal up
    to one step's rounding): every step then starts both from the same values and gets
    bitwise equal gradients, so only that step's arithmetic is compared. Without it rounding
    differences grow through the forwards, without bound where a gradient is mathematically
    zero and numerically noise (before a normalization over two values, say), and AdamW
    turns such noise into steps of size lr."""
    for _, a, b in pairs:
        a.copy_(b)
        state = ref_opt.state.get(a, {})
        for key, value in state.items():
            value.copy_(our_opt.state[b][key])


def _check_same_on_every_rank(pairs, group: dist.ProcessGroup, what: str) -> None:
    """DDP's invariant: every rank holds bitwise the same parameters after a step."""
    for name, _, b in pairs:
        mine = b.detach().clone()
        theirs = mine.clone()
        dist.broadcast(theirs, src=0, group=group)
        assert torch.equal(mine, theirs), f"{what} {name}: leanddp's differs from rank 0's"


def run_example(spec: Spec, rank: int, groups: tuple[dist.ProcessGroup, dist.ProcessGroup]) -> None:
    """Trains torch's DDP and leanddp side by side as ``spec`` says; raises AssertionError on
    the first difference. With two ranks and the same torch optimizer on both sides the
    arithmetic is the same (divide by 2, one addition), so gradients, parameters and buffers
    are bitwise equal (as in tests/ddp/test_ddp_parity.py). With optimizer_in_backward buffers
    are bitwise equal too, and each step's parameters and optimizer state within STEP_RTOL."""
    torch.manual_seed(spec.seed + 1000 * rank)  # different initial weights on every rank
    model = PropNet(spec, rank)
    factory = OPTIMIZERS[spec.optimizer]
    kwargs = spec.ddp_kwargs()
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=groups[0], **kwargs
    )
    # (in-backward: torch's fused Adam(W), which leanddp's kernels equal bit for bit)
    params = ref.module.parameters()
    ref_opt = reference_optimizer(factory, params) if spec.in_backward else factory(params)
    if spec.in_backward:
        ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model),
            process_group=groups[1],
            optimizer_in_backward=factory,
            offload_to_cpu=spec.offload,
            **kwargs,
        )
        our_opt = ours.optimizer
    else:
        ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model), process_group=groups[1], **kwargs
        )
        our_opt = factory(ours.module.parameters())
    scheds = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        for opt in (ref_opt, our_opt)
        if spec.scheduler
    ]
    pairs = [
        (name, a, b)
        for (name, a), b in zip(
            ref.module.named_parameters(), ours.module.parameters(), strict=True
        )
    ]
    gen = torch.Generator().manual_seed(spec.seed * 2 + rank)  # different data on every rank
    it = 0
    for step in range(spec.steps):
        # torch's DDP asserts when a static graph's first iteration runs under no_sync
        n = 1 if spec.static_graph and step == 0 else spec.accum
        batches = [
            (
                torch.randn(spec.batch, spec.seq, spec.in_width, generator=gen),
                torch.randint(0, VOCAB, (spec.batch, spec.seq), generator=gen),
            )
            for _ in range(n)
        ]
        what = f"rank {rank} step {step}"
        if not spec.in_backward:
            for opt in (ref_opt, our_opt):
                opt.zero_grad(set_to_none=spec.set_to_none)
        for ddp in (ref, ours):
            _forward_backward(ddp, batches, it)
        it += n
        if spec.in_backward:
            for name, _, b in pairs:
                assert b.grad is None, f"{what}: {name} has a gradient after an in-backward step"
        else:
            for name, a, b in pairs:
                _compare(a.grad, b.grad, f"{what} grad of {name}", None)
        before = [a.detach().clone() for _, a, _ in pairs]
        ref_opt.step()
        if spec.in_backward:
            ref_opt.zero_grad()
            if spec.legacy_calls:
                our_opt.step()
                our_opt.zero_grad()
        else:
            our_opt.step()
        for sched in scheds:
            sched.step()
        if spec.offload:
            ours.synchronize()  # the host steps are done and the weights copied back
        for (name, a, b), a0 in zip(pairs, before, strict=True):
            # bitwise where the same torch optimizer steps both sides
            tol, scale = _step_tol(spec, ref_opt, a), (a.detach() - a0).abs().max().item()
            _compare(a.detach(), b.detach(), f"{what} {name}", tol, scale)
        for (name, a), b in zip(ref.module.named_buffers(), ours.module.buffers(), strict=True):
            # the forwards ran on the same (re-synchronized) parameters: bitwise equal
            _compare(a, b, f"{what} buffer {name}", None)
        _check_same_on_every_rank(pairs, groups[0], what)
        if spec.in_backward:
            _compare_state(spec, ref_opt, our_opt, pairs, what)
            _resync(ref_opt, our_opt, pairs)

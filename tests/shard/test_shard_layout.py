"""shard_optimizer_state's cut of a bucket (csrc/shard.h), for any slots, world size and
alignment hypothesis draws: the padded bucket splits into equal, aligned shards, and the ranks'
pieces tile every slot exactly once, each inside its rank's shard, in layout order. Then the
reduction that leaves each rank its shard summed, on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from leanddp import _C


@st.composite
def buckets(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """Slot offsets, slot sizes (empty slots included) and the bucket size, with gaps."""
    offsets, numels, at = [], [], 0
    for _ in range(draw(st.integers(0, 8))):
        at += draw(st.integers(0, 3))  # a gap before the slot (alignment in a real bucket)
        numel = draw(st.integers(0, 40))
        offsets.append(at)
        numels.append(numel)
        at += numel
    return offsets, numels, at + draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(bucket=buckets(), world=st.integers(1, 6), align=st.sampled_from([1, 2, 4, 8]))
def test_shards_tile_every_slot_once(bucket: tuple, world: int, align: int) -> None:
    offsets, numels, bucket_numel = bucket
    layouts = [
        _C.shard_layout(offsets, numels, bucket_numel, align, world, r) for r in range(world)
    ]
    padded, shard = layouts[0]["padded"], layouts[0]["shard_numel"]
    assert padded >= bucket_numel and padded - bucket_numel < world * align
    assert padded == world * shard and shard % align == 0
    covered = [[0] * n for n in numels]
    for rank, layout in enumerate(layouts):
        assert (layout["padded"], layout["shard_numel"]) == (padded, shard)
        assert layout["begin"] == rank * shard
        last_end = 0
        for slot, slot_offset, shard_offset, numel in layout["pieces"]:
            assert numel > 0 and shard_offset >= last_end and shard_offset + numel <= shard
            # the piece is where the slot's elements sit in the bucket
            assert layout["begin"] + shard_offset == offsets[slot] + slot_offset
            last_end = shard_offset + numel
            for e in range(slot_offset, slot_offset + numel):
                covered[slot][e] += 1
        slots = [piece[0] for piece in layout["pieces"]]
        assert slots == sorted(slots)
    assert all(c == 1 for slot in covered for c in slot), covered


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([0], [4], 4, 1, 0, 0), "world must be at least 1"),
        (([0], [4], 4, 1, 2, 2), r"rank must be in \[0, 2\)"),
        (([0], [4], 4, 0, 2, 0), "align must be at least 1"),
        (([0], [4, 1], 5, 1, 2, 0), "1 offsets for 2 slots"),
        (([0, 3], [4, 1], 5, 1, 2, 0), "slot 1 .* does not follow"),
        (([2], [4], 5, 1, 2, 0), "slot 0 .* inside the bucket of 5"),
    ],
)
def test_bad_arguments_are_named(args: tuple, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        _C.shard_layout(*args)


def _reduce_to_shard(rank: int, world_size: int) -> None:
    group = dist.new_group()
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        offsets, numels = [0, 7, 20], [5, 13, 9]  # a gap (alignment), slots cut by shard ends
        layout = _C.shard_layout(offsets, numels, 29, 4, world_size, rank)
        flat = torch.randn(layout["padded"]).to(dtype)
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat, group=group)
        expected = torch.stack(everyone).sum(0, dtype=torch.float64)
        _C._testing.reduce_to_shard(group, flat, offsets, numels, 29, 4)
        begin, end = layout["begin"], layout["begin"] + layout["shard_numel"]
        # bfloat16: every partial sum of the ring rounds (half an ulp of values up to ~8: 0.03)
        tolerance = dict(rtol=1.6e-2, atol=0.1) if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(flat[begin:end], expected[begin:end].to(dtype), **tolerance)
    with pytest.raises(RuntimeError, match="contiguous 1-D tensor of"):
        _C._testing.reduce_to_shard(group, torch.zeros(3), [0], [5], 5, 4)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extra_ranks)])
def test_reduce_to_shard_sums_each_ranks_shard(world_size: int) -> None:
    """gloo's path (an allreduce, the rank keeps its shard) against an all-gather and a sum,
    at 3 ranks with padding and slots cut by shard boundaries."""
    run_ranks(world_size, _reduce_to_shard)


def _pack_and_gather(rank: int, world_size: int) -> None:
    group = dist.new_group()
    offsets, numels, bucket_numel = [0, 7, 20], [5, 13, 9], 29
    layout = _C.shard_layout(offsets, numels, bucket_numel, 4, world_size, rank)
    shard = layout["shard_numel"]
    for dtype in (torch.float32, torch.bfloat16):
        # this rank's weights: rank, slot and element in the value (exact in bfloat16)
        sources = [
            (rank * 64 + s * 8 + torch.arange(n) % 8).to(dtype) for s, n in enumerate(numels)
        ]
        flat = torch.full((layout["padded"],), -1.0, dtype=dtype)
        _C._testing.pack_and_gather_shards(group, flat, offsets, numels, bucket_numel, 4, sources)
        for s, (offset, n) in enumerate(zip(offsets, numels, strict=True)):
            owner = (offset + torch.arange(n)) // shard  # the rank whose shard holds the element
            expected = (owner * 64 + s * 8 + torch.arange(n) % 8).to(dtype)
            assert torch.equal(flat[offset : offset + n], expected), f"{dtype} slot {s}"
    # a wrong source raises before any collective (on every rank alike), naming the slot
    first_slot = layout["pieces"][0][0]
    with pytest.raises(RuntimeError, match=f"the source of slot {first_slot} must be a 1-D"):
        wrong = [t.double() for t in sources]
        _C._testing.pack_and_gather_shards(group, flat, offsets, numels, bucket_numel, 4, wrong)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extra_ranks)])
def test_gathered_shards_hold_each_owners_weights(world_size: int) -> None:
    """Each rank packs its pieces of the weights into its shard; the in-place all-gather then
    gives every rank the owner's values in every slot (gloo, 2 and 3 ranks)."""
    run_ranks(world_size, _pack_and_gather)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_pieces_stepped_per_rank_equal_the_whole_step(world_size: int) -> None:
    """The sharded step's arithmetic, simulated in one process: every rank steps only its
    pieces (slices of cut parameters, each with its parameter's tail) with the fused AdamW kernel
    and state for its shard alone;
    put together, the weights are bitwise those of the fused step over whole parameters, and
    within 1e-5 of torch's AdamW, over several steps with averaged random gradients."""
    from leanddp.ops import adamw_step_

    shapes = [(7, 3), (5,), (4, 4, 2), (1,), (11,)]
    start = [torch.randn(s) for s in shapes]
    numels = [t.numel() for t in start]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    bucket_numel, align = sum(numels), 2
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    whole = [t.clone() for t in start]
    whole_state = [(torch.zeros_like(t), torch.zeros_like(t)) for t in start]
    ref = [t.clone().requires_grad_() for t in start]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    layouts = [
        _C.shard_layout(offsets, numels, bucket_numel, align, world_size, r)
        for r in range(world_size)
    ]
    shard_numel = layouts[0]["shard_numel"]
    # per rank: its own copy of the weights (all equal between steps) and its shard's state
    weights = [[t.clone() for t in start] for _ in range(world_size)]
    states = [(torch.zeros(shard_numel), torch.zeros(shard_numel)) for _ in range(world_size)]
    for step in range(1, 5):
        grads = [[torch.randn(s) for s in shapes] for _ in range(world_size)]
        mean = [torch.stack(g).mean(0) for g in zip(*grads, strict=True)]
        adamw_step_(
            whole,
            mean,
            [m for m, _ in whole_state],
            [v for _, v in whole_state],
            step=step,
            **hyper,
        )
        for p, g in zip(ref, mean, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        # the reduce-scatter: the padded bucket of averaged gradients, each rank its shard
        flat_grad = torch.zeros(layouts[0]["padded"])
        for g, offset, n in zip(mean, offsets, numels, strict=True):
            flat_grad[offset : offset + n] = g.reshape(-1)
        for rank, layout in enumerate(layouts):
            grad_shard = flat_grad[layout["begin"] : layout["begin"] + shard_numel]
            pieces = layout["pieces"]
            if not pieces:
                continue
            adamw_step_(
                [weights[rank][s].view(-1)[o : o + n] for s, o, _, n in pieces],
                [grad_shard[at : at + n] for _, _, at, n in pieces],
                [states[rank][0][at : at + n] for _, _, at, n in pieces],
                [states[rank][1][at : at + n] for _, _, at, n in pieces],
                step=step,
                # each piece takes its parameter's tail (the last numel % 8 floats), as the
                # sharded FusedOptimizer passes it
                tail_from=[numels[s] - numels[s] % 8 - o for s, o, _, _ in pieces],
                **hyper,
            )
        # the all-gather: every rank's copy takes each owner's pieces
        flat = torch.zeros(layouts[0]["padded"])
        for rank, layout in enumerate(layouts):
            begin = layout["begin"]
            for s, o, at, n in layout["pieces"]:
                flat[begin + at : begin + at + n] = weights[rank][s].view(-1)[o : o + n]
        for rank in range(world_size):
            for s, (offset, n) in enumerate(zip(offsets, numels, strict=True)):
                weights[rank][s].view(-1).copy_(flat[offset : offset + n])
        for rank in range(world_size):
            for s in range(len(shapes)):
                assert torch.equal(weights[rank][s], whole[s]), f"step {step} rank {rank} slot {s}"
        for s in range(len(shapes)):
            torch.testing.assert_close(whole[s], ref[s].detach(), rtol=1e-5, atol=1e-6)

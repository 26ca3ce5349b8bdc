"""shard_optimizer_state's cut of a bucket (csrc/shard.h), for any slots, world size and
alignment hypothesis draws: the padded bucket splits into equal, aligned shards, and the ranks'
pieces tile every slot exactly once, each inside its rank's shard, in layout order."""

from __future__ import annotations

import pytest
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

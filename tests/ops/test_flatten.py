"""flatten_into / unflatten_from against torch.cat and views, on fresh random data."""

from __future__ import annotations

import random

import pytest
import torch
from torch.library import opcheck

from leanddp import ops

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ALL_DTYPES = FLOAT_DTYPES + [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
# Sizes that break 16-byte vector alignment, 1-element and empty tensors, and a few large ones.
SIZES = [0, 1, 2, 3, 5, 7, 8, 15, 17, 31, 127, 1000, 1023, 4099, 70_001]


def _rand(shape, dtype, device):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, device=device).to(dtype)


def _random_shape():
    n = random.choice(SIZES)
    kind = random.randrange(4)
    if kind == 0 or n < 4:
        return (n,)
    if kind == 1:
        return (n, random.choice([1, 2, 3]))
    if kind == 2:
        return (random.choice([2, 3]), n, 1)
    return (2, 1, 3, n)


def _noncontiguous(t):
    """A non-contiguous tensor holding `t`'s values: transposed, strided slice, or channels-last."""
    kind = random.randrange(3)
    if kind == 0 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == 1 or t.dim() < 4:
        big = torch.zeros((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        view = big[::2]
        view.copy_(t)
        return view
    return t.contiguous(memory_format=torch.channels_last)


def _tensor_list(dtype, device, count, noncontiguous_share=0.3):
    ts = []
    for _ in range(count):
        t = _rand(_random_shape(), dtype, device)
        if random.random() < noncontiguous_share:
            t = _noncontiguous(t)
        ts.append(t)
    return ts


def _expected_flat(ts, scale):
    flat = torch.cat([t.reshape(-1) for t in ts]) if ts else None
    return flat if scale is None or flat is None else flat * scale


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_flatten_matches_cat(device, dtype):
    for count in (1, 2, 7, 40):
        ts = _tensor_list(dtype, device, count)
        total = sum(t.numel() for t in ts)
        sentinel = _rand((total + 9,), dtype, device)
        out = sentinel.clone()
        result = ops.flatten_into(ts, out)
        assert result is out
        assert torch.equal(out[:total], _expected_flat(ts, None))
        assert torch.equal(out[total:], sentinel[total:]), "elements past the total were written"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_flatten_scale_matches_torch_mul(device, dtype):
    scale = random.uniform(-3, 3)
    ts = _tensor_list(dtype, device, 25)
    out = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)
    ops.flatten_into(ts, out, scale=scale)
    assert torch.equal(out, _expected_flat(ts, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("misalign", [0, 1, 3])
def test_flatten_misaligned_out(device, dtype, misalign):
    """`out` starting off a 16-byte boundary still gives exact results."""
    ts = [_rand((random.choice(SIZES[1:]),), dtype, device) for _ in range(12)]
    total = sum(t.numel() for t in ts)
    base = torch.zeros(total + misalign, dtype=dtype, device=device)
    ops.flatten_into(ts, base[misalign:])
    assert torch.equal(base[misalign:], _expected_flat(ts, None))


def test_flatten_empty_list_and_empty_tensors(device):
    out = torch.randn(5, device=device)
    before = out.clone()
    ops.flatten_into([], out)
    ops.flatten_into([torch.empty(0, device=device), torch.empty(3, 0, device=device)], out)
    assert torch.equal(out, before)
    ops.unflatten_from(out, [])


def test_flatten_many_small_tensors(device):
    ts = [torch.randn(random.randint(1, 4096), device=device) for _ in range(2000)]
    out = torch.empty(sum(t.numel() for t in ts), device=device)
    ops.flatten_into(ts, out, scale=0.5)
    assert torch.equal(out, _expected_flat(ts, 0.5))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_unflatten_inverse(device, dtype):
    for count in (1, 5, 30):
        # Destinations: contiguous tensors and non-contiguous views into larger bases.
        bases, dsts = [], []
        for _ in range(count):
            shape = _random_shape()
            if random.random() < 0.4 and shape[0] > 0:
                base = _rand((shape[0] * 2,) + shape[1:], dtype, device)
                dst = base[::2]
            else:
                base = _rand(shape, dtype, device)
                dst = base
            bases.append((base, base.clone()))
            dsts.append(dst)
        total = sum(d.numel() for d in dsts)
        flat = _rand((total + 4,), dtype, device)
        ops.unflatten_from(flat, dsts)
        offset = 0
        for (base, original), dst in zip(bases, dsts, strict=True):
            n = dst.numel()
            assert torch.equal(dst, flat[offset : offset + n].view(dst.shape))
            if dst.data_ptr() != base.data_ptr() or dst.shape != base.shape:
                untouched = base[1::2]
                assert torch.equal(untouched, original[1::2]), "memory outside the view changed"
            offset += n


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unflatten_scale(device, dtype):
    scale = random.uniform(-2, 2)
    dsts = _tensor_list(dtype, device, 20)
    flat = _rand((sum(d.numel() for d in dsts),), dtype, device)
    ops.unflatten_from(flat, dsts, scale=scale)
    assert torch.equal(torch.cat([d.reshape(-1) for d in dsts]), flat * scale)


def test_round_trip(device):
    ts = _tensor_list(torch.float32, device, 30)
    originals = [t.clone() for t in ts]
    out = torch.empty(sum(t.numel() for t in ts), device=device)
    ops.flatten_into(ts, out)
    for t in ts:
        t.zero_()
    ops.unflatten_from(out, ts)
    for t, o in zip(ts, originals, strict=True):
        assert torch.equal(t, o)


def test_bucket_views_are_left_in_place_or_scaled(device):
    """Tensors that already are their own slices of `out` (gradient bucket views)."""
    bucket = torch.randn(100, device=device)
    views = [bucket[0:30].view(5, 6), bucket[30:31], bucket[31:100]]
    original = bucket.clone()
    ops.flatten_into(views, bucket)
    assert torch.equal(bucket, original)
    ops.flatten_into(views, bucket, scale=0.25)
    assert torch.equal(bucket, original * 0.25)
    ops.unflatten_from(bucket, views, scale=2.0)
    assert torch.equal(bucket, original * 0.5)


def _permuted_views(flat):
    """Views of consecutive slices of `flat` (from element 0), each dense in a non-contiguous
    layout as a bucket keeps a parameter's strides: channels_last, a transposed matrix, a 3-D
    permutation; then a contiguous one. Returns the views and the elements they cover."""
    layouts = [
        torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        torch.empty(7, 5).t(),
        torch.empty(4, 2, 3).permute(1, 2, 0),
        torch.empty(3, 3),
    ]
    views, offset = [], 0
    for like in layouts:
        views.append(flat.as_strided(like.shape, like.stride(), offset))
        offset += like.numel()
    assert all(not v.is_contiguous() for v in views[:3])
    return views, offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permuted_bucket_views_are_left_in_place_or_scaled(device, dtype):
    """Tensors that are their own slices in a permuted dense layout (channels_last, transposed
    parameters' gradient views): in place, the slice's elements scaled as `tensor * scale`,
    next to a tensor of its own that is copied into its slice in row-major order."""
    scale = random.uniform(-3, 3)
    flat = _rand((400,), dtype, device)
    views, covered = _permuted_views(flat)
    own = _noncontiguous(_rand((2, 3, 4, 5), dtype, device))  # a separate (gradient) tensor
    original = flat.clone()
    ops.flatten_into(views, flat)
    assert torch.equal(flat, original)
    ops.flatten_into(views + [own], flat, scale=scale)
    assert torch.equal(flat[:covered], original[:covered] * scale)
    assert torch.equal(flat[covered : covered + own.numel()], own.reshape(-1) * scale)
    assert torch.equal(flat[covered + own.numel() :], original[covered + own.numel() :])
    scaled = flat.clone()
    ops.unflatten_from(flat, views)
    assert torch.equal(flat, scaled)
    back = torch.zeros_like(own)
    ops.unflatten_from(flat, views + [back], scale=0.5)
    assert torch.equal(flat[:covered], scaled[:covered] * 0.5)
    assert torch.equal(back, (scaled[covered : covered + own.numel()] * 0.5).view(own.shape))


def test_permuted_views_off_their_slice_are_rejected(device):
    """Sharing the flat buffer stays legal only for a dense tensor exactly on its own slice."""
    flat = torch.randn(200, device=device)
    views, _ = _permuted_views(flat)
    c_last, transposed = views[0], views[1]
    shifted = flat.as_strided(c_last.shape, c_last.stride(), 1)  # one element late
    _assert_rejected(
        ValueError,
        r"tensors\[0\] overlaps out outside its own slice \[0, 120\)",
        lambda: ops.flatten_into([shifted], flat, scale=2.0),
        flat,
    )
    gappy = flat.as_strided((5, 7), (1, 6), 120)  # transposed, its offset, but with gaps
    _assert_rejected(
        ValueError,
        r"tensors\[1\] overlaps flat outside its own slice",
        lambda: ops.unflatten_from(flat, [c_last, gappy], scale=2.0),
        flat,
    )
    _assert_rejected(  # the right layout, in another tensor's slice
        ValueError,
        r"tensors\[0\] overlaps out outside its own slice",
        lambda: ops.flatten_into([transposed, c_last], flat),
        flat,
    )
    expanded = flat[120:125].view(5, 1).expand(5, 7)
    _assert_rejected(
        ValueError,
        r"tensors\[1\] has internally overlapping memory",
        lambda: ops.unflatten_from(flat, [c_last, expanded]),
        flat,
    )


def test_very_high_rank_noncontiguous(device):
    """A non-contiguous tensor with more dims than the kernels index directly."""
    t = torch.randn([2] * 9, device=device).permute(*reversed(range(9)))  # 9 dims, none mergeable
    assert not t.is_contiguous()
    out = torch.empty(t.numel() + 3, device=device)
    ops.flatten_into([torch.ones(3, device=device), t], out, scale=3.0)
    assert torch.equal(out, torch.cat([torch.ones(3, device=device), t.reshape(-1)]) * 3.0)
    back = torch.zeros_like(t)
    ops.unflatten_from(out[3:], [back], scale=1 / 3.0)
    torch.testing.assert_close(back, t)


# --- bad input: a clear error that names the argument, and nothing written -----------------


def _assert_rejected(exc_type, match, fn, *watched):
    before = [w.clone() for w in watched]
    with pytest.raises(exc_type, match=match):
        fn()
    for w, b in zip(watched, before, strict=True):
        assert torch.equal(w, b), "a rejected call wrote to its output"


def test_flatten_bad_input(device):
    a, b = torch.randn(4, device=device), torch.randn(3, device=device)
    out = torch.randn(7, device=device)
    _assert_rejected(
        TypeError, r"tensors\[1\] has dtype Half", lambda: ops.flatten_into([a, b.half()], out), out
    )
    _assert_rejected(
        ValueError,
        r"out has 6 elements but the tensors hold 7",
        lambda: ops.flatten_into([a, b], out[:6]),
        out,
    )
    _assert_rejected(
        TypeError, r"out has dtype Double", lambda: ops.flatten_into([a, b], out.double()), out
    )
    _assert_rejected(
        ValueError, r"out must be 1-D", lambda: ops.flatten_into([a], out[:4].view(2, 2)), out
    )
    _assert_rejected(
        ValueError, r"out must be contiguous", lambda: ops.flatten_into([a[:2]], out[::2]), out
    )
    ints = torch.arange(7, device=device)
    _assert_rejected(
        TypeError,
        r"scale needs dtype Float, Double, Half or BFloat16, got Long",
        lambda: ops.flatten_into([ints], ints.clone(), scale=2.0),
        ints,
    )
    _assert_rejected(
        ValueError,
        r"scale must be finite",
        lambda: ops.flatten_into([a, b], out, scale=float("nan")),
        out,
    )
    # A tensor overlapping `out` somewhere other than its own slice.
    _assert_rejected(
        ValueError,
        r"tensors\[1\] overlaps out outside its own slice",
        lambda: ops.flatten_into([a, out[0:3]], out),
        out,
    )
    if torch.cuda.is_available():
        other = "cpu" if device == "cuda" else "cuda"
        _assert_rejected(
            ValueError, r"tensors\[1\] is on", lambda: ops.flatten_into([a, b.to(other)], out), out
        )


def test_scale_rejected_for_float8_before_writing(device):
    """Float8 is floating point but has no scaled kernel: rejected by the checks, out untouched
    (also for a >6-dim tensor, which would otherwise be staged into out first)."""
    t = torch.randn([2] * 9, device=device).to(torch.float8_e4m3fn).permute(*reversed(range(9)))
    out = torch.zeros(512, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="scale needs dtype Float, Double, Half or BFloat16"):
        ops.flatten_into([t], out, scale=2.0)
    assert (out.float() == 0).all()


def test_unflatten_bad_input(device):
    flat = torch.randn(10, device=device)
    a, b = torch.zeros(4, device=device), torch.zeros(3, device=device)
    _assert_rejected(
        ValueError,
        r"flat has 5 elements but the tensors hold 7",
        lambda: ops.unflatten_from(flat[:5], [a, b]),
        a,
        b,
    )
    _assert_rejected(
        TypeError,
        r"tensors\[0\] has dtype Half",
        lambda: ops.unflatten_from(flat, [a.half(), b]),
        b,
    )
    _assert_rejected(
        ValueError,
        r"(tensors\[0\] and tensors\[1\]|tensors\[1\] and tensors\[0\]) share memory",
        lambda: ops.unflatten_from(flat, [a, a[1:]]),
        a,
    )
    expanded = torch.zeros(1, device=device).expand(4)
    _assert_rejected(
        ValueError,
        r"tensors\[1\] has internally overlapping memory",
        lambda: ops.unflatten_from(flat, [a, expanded]),
        a,
    )


# --- custom-op registration -------------------------------------------------------------------


def test_opcheck(device):
    ts = [
        torch.randn(3, 4, device=device),
        torch.randn(5, device=device).t(),
        torch.randn(4, 3, device=device).t(),
    ]
    out = torch.empty(30, device=device)
    opcheck(torch.ops.leanddp.flatten_into.default, (ts, out, None))
    opcheck(torch.ops.leanddp.flatten_into.default, (ts, out, 0.5))
    opcheck(torch.ops.leanddp.unflatten_from.default, (out, ts, 2.0))

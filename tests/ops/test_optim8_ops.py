"""The block-wise 8-bit Adam(W) op against torchao's own AdamW8bit and Adam8bit, several steps.

torchao's optimizer steps every parameter with its compiled ``single_param_adam``; the op steps
the same parameters and state through its own kernels. On the CPU torchao's compiled code rounds
as the kernel does (float32, no fused multiply-adds, IEEE division), so parameters, codes and
scales must agree bit for bit. On a GPU torchao's generated code fuses multiply-adds and the
kernel does not, so parameters agree to float32 rounding and codes where a value sits on a
rounding boundary may differ by one: at least 99.9% must be equal.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from leanddp import ops

torchao_optim = pytest.importorskip("torchao.optim", reason="torchao (leanddp[lowbit]) is needed")
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402

STEPS = 4
# 8-bit state: 2 x 256-blocks x 64 and 16 blocks; plain: under 4096 elements, and not a multiple
# of the block. Few shapes: torchao compiles its step once per shape.
SHAPES = [(64, 256), (4096,), (1000,), (4100,)]
CODES_EQUAL = 0.999  # on a GPU, the least fraction of equal codes


class _Run:
    """Parameters stepped by torchao's optimizer and, from clones, by leanddp's op."""

    def __init__(self, device, dtype, cls, **hyper):
        self.device, self.dtype, self.hyper = device, dtype, hyper
        self.lr = hyper.get("lr", 1e-3)
        self.ref = [torch.randn(s, device=device).to(dtype).requires_grad_(True) for s in SHAPES]
        self.params = [p.detach().clone() for p in self.ref]
        self.opt = cls(self.ref, **hyper)
        self.steps = 0
        self.exp_avg, self.exp_avg_sq, self.scale_m, self.scale_v = [], [], [], []
        for p in self.params:
            big = p.numel() >= 4096 and p.numel() % 256 == 0
            for codes, scales in ((self.exp_avg, self.scale_m), (self.exp_avg_sq, self.scale_v)):
                codes.append(torch.zeros_like(p, dtype=torch.uint8) if big else torch.zeros_like(p))
                scales.append(torch.zeros(p.numel() // 256 if big else 0, device=device))
        self.qs = OptimState8bit.zeros((256,), True, 256, device).qmap
        self.qu = OptimState8bit.zeros((256,), False, 256, device).qmap

    def step(self, grad_scale=None, found_inf=None):
        grads = [torch.randn_like(p) for p in self.params]
        for r, g in zip(self.ref, grads, strict=True):
            r.grad = g * grad_scale if grad_scale is not None else g.clone()
        if found_inf is None or found_inf.item() == 0:
            self.opt.step()
            self.steps += 1
        group = self.opt.param_groups[0]
        ops.adam8bit_step_(
            self.params,
            grads,
            self.exp_avg,
            self.exp_avg_sq,
            self.scale_m,
            self.scale_v,
            self.qs,
            self.qu,
            lr=float(group["lr"]),
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=max(self.steps, 1),
            decoupled_weight_decay=self.opt.is_adamw,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )

    def check(self):
        """Parameters, codes and scales equal to torchao's (on a GPU: close, and 99.9% of codes)."""
        exact = self.device == "cpu"
        # On a GPU a code one step apart (torchao's fused multiply-adds) moves m by up to 1.4% of
        # its block's scale (the widest step of the map near 1), and the parameter by about
        # lr * 1.4% in the next update: atol 3 * lr * 1.4% holds a few such flips (and a bf16
        # parameter one bf16 ulp, rtol 2^-7, where a flip moves it across a rounding).
        rtol = 0.0 if self.dtype == torch.float32 else 2**-7
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=rtol, atol=3 * 0.014 * self.lr)
        codes_equal = 1.0 if exact else CODES_EQUAL
        for i, (ours, ref) in enumerate(zip(self.params, self.ref, strict=True)):
            torch.testing.assert_close(ours, ref.detach(), **tol, msg=f"param {i}")
            state = self.opt.state[ref]
            for key, codes, scales in (
                ("exp_avg", self.exp_avg, self.scale_m),
                ("exp_avg_sq", self.exp_avg_sq, self.scale_v),
            ):
                theirs = state[key]
                if isinstance(theirs, OptimState8bit):
                    equal = (codes[i] == theirs.codes).float().mean().item()
                    assert equal >= codes_equal, f"param {i} {key}: {equal:.5f} of codes equal"
                    torch.testing.assert_close(scales[i], theirs.scale, **tol)
                else:
                    assert scales[i].numel() == 0, f"param {i} {key}: torchao keeps it plain"
                    torch.testing.assert_close(codes[i], theirs, **tol, msg=f"param {i} {key}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", ["AdamW8bit", "Adam8bit"])
def test_matches_torchao(device, cls, dtype):
    torch.manual_seed(0)
    run = _Run(device, dtype, getattr(torchao_optim, cls), lr=1e-2, weight_decay=0.1)
    for _ in range(STEPS):
        run.step()
        run.check()


def test_matches_torchao_with_clipping_betas_and_a_skipped_step():
    """grad_scale multiplies the gradients (clipping); found_inf skips the call; beta1 < 0.5."""
    torch.manual_seed(1)
    run = _Run("cpu", torch.float32, torchao_optim.AdamW8bit, lr=3e-3, betas=(0.3, 0.95))
    run.step(grad_scale=0.25)
    run.step(found_inf=torch.ones(()))
    run.check()
    run.step(grad_scale=0.5, found_inf=torch.zeros(()))
    run.check()


def test_param_copy_receives_the_update():
    torch.manual_seed(2)
    p = torch.randn(8192)
    copy = torch.empty(8192, dtype=torch.bfloat16)
    codes = [torch.zeros(8192, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(32) for _ in range(2)]
    run = _Run("cpu", torch.float32, torchao_optim.AdamW8bit)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    ops.adam8bit_step_(
        p, torch.randn(8192, dtype=torch.bfloat16), *codes, *scales, run.qs, run.qu,
        param_copy=copy, **kw,
    )  # fmt: skip
    assert torch.equal(copy, p.bfloat16())


def _args(device, block=256):
    p = [torch.randn(4, block, device=device), torch.randn(300, device=device)]
    g = [torch.randn_like(t) for t in p]
    m = [torch.zeros(4, block, dtype=torch.uint8, device=device), torch.zeros(300, device=device)]
    v = [t.clone() for t in m]
    sm = [torch.zeros(4, device=device), torch.zeros(0, device=device)]
    sv = [t.clone() for t in sm]
    qs = OptimState8bit.zeros((256,), True, 256, device).qmap
    qu = OptimState8bit.zeros((256,), False, 256, device).qmap
    return p, g, m, v, sm, sv, qs, qu


def _empty_8bit():
    """params, grads, codes, codes, scales, scales of an empty parameter with 8-bit state."""
    codes = torch.zeros(0, dtype=torch.uint8)
    return torch.zeros(0), torch.zeros(0), codes, codes.clone(), torch.zeros(1), torch.zeros(1)


KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2)


def test_opcheck(device):
    args = _args(device)
    opcheck(
        torch.ops.leanddp.adam8bit_step_.default,
        (*args[:6], [], *args[6:]),
        KW | dict(decoupled_weight_decay=True, grad_scale=0.5),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a[3].__setitem__(0, a[3][0].float()), r"exp_avg_sq\[0\] has dtype Float"),
        (lambda a: a[4].__setitem__(0, torch.zeros(3)), r"exp_avg_scale\[0\] must be a contig"),
        (lambda a: a[5].__setitem__(1, torch.zeros(2)), r"exp_avg_sq_scale\[1\] must be empty"),
        (
            lambda a: (a[0].__setitem__(0, a[0][0].t()), a[1].__setitem__(0, a[1][0].t())),
            r"must be contiguous for 8-bit state",
        ),
        (lambda a: a.__setitem__(6, a[6][:128]), r"qmap_signed must be a contiguous 1-D"),
        (lambda a: a.__setitem__(7, a[7].double()), r"qmap_unsigned has dtype Double"),
        (lambda a: a[3].__setitem__(1, a[0][1]), r"share memory"),
        (  # an empty parameter with 8-bit state: no block to divide it into
            lambda a: [lst.__setitem__(0, t) for lst, t in zip(a[:6], _empty_8bit(), strict=True)],
            r"exp_avg_scale\[0\] must be a contiguous 1-D tensor of one scale per block",
        ),
    ],
)
def test_bad_input_is_refused_before_any_write(change, message):
    args = list(_args("cpu", block=512))
    change(args)
    before = [t.clone() for lst in args[:6] for t in lst]
    with pytest.raises(ValueError if "dtype" not in message else TypeError, match=message):
        ops.adam8bit_step_(*args, **KW)
    after = [t for lst in args[:6] for t in lst]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _sweep(qmap: torch.Tensor) -> torch.Tensor:
    """Floats where codes change or could go wrong: every map entry, the midpoints between
    neighbours (where rounding turns) and a few ulps around each, a stride over every float
    pattern in [-1, 1], signed zeros, the limits, NaNs of both signs, infinities, magnitudes past
    1 and too small for any code."""
    mids = (qmap[:-1] + qmap[1:]) / 2
    points = torch.cat([qmap, mids])
    near = [points]
    for _ in range(3):
        near.append(torch.nextafter(near[-1], torch.tensor(2.0)))
    down = [points]
    for _ in range(3):
        down.append(torch.nextafter(down[-1], torch.tensor(-2.0)))
    stride = torch.arange(0, 0x3F800001, 997, dtype=torch.int64).to(torch.int32).view(torch.float32)
    inf, nan = float("inf"), float("nan")
    extremes = [nan, -nan, inf, -inf, 3e38, -3e38, 2.0]
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-40, -1e-40, *extremes])
    # first (in whole vectors of 16) and last (in the kernels' scalar remainder)
    return torch.cat([special, *near, *down, stride, -stride, special]).contiguous()


@pytest.mark.parametrize("signed", [True, False])
def test_dequantizer_equals_the_map_times_the_scale(signed):
    """Both dequantizer paths (byte shuffles where the CPU has AVX-512 VBMI, else gathers) give
    qmap[code] * scale bit for bit: every code in every position of a 64-code vector, in whole
    vectors and the remainder, at scales that keep, round and flush the products."""
    from leanddp._C import _testing

    qmap = OptimState8bit.zeros((256,), signed, 256, "cpu").qmap
    every = torch.arange(256, dtype=torch.uint8)
    # each code at each position mod 64: rotations of 0..255, then a remainder of 37
    codes = torch.cat([every.roll(k) for k in range(64)] + [every[:37]]).contiguous()
    for scale in (1.0, 0.0123, 3e-39, 1e-12, 2.5e30):
        expected = qmap[codes.long()] * torch.tensor(scale, dtype=torch.float32)
        for table in (True, False):
            out = _testing.dequantize8(codes, qmap, scale, table=table)
            assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (
                f"scale {scale}, table {table}: {(out != expected).sum()} differ"
            )


@pytest.mark.parametrize("signed", [True, False])
def test_quantizer_tables_equal_the_binary_search(signed):
    """quant_table's two look-ups give the binary search's codes, and both torchao's; so does
    the path for blocks known to lie in [-1, 1] (no NaN, no clamp above 1.0)."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    from leanddp._C import _testing

    qmap = OptimState8bit.zeros((256,), signed, 256, "cpu").qmap
    x = _sweep(qmap)
    fast = _testing.quantize8(x, qmap, True)
    search = _testing.quantize8(x, qmap, False)
    theirs = quantize_8bit_with_qmap(x, qmap)
    assert torch.equal(fast, search), f"{(fast != search).sum()} of {x.numel()} codes differ"
    assert torch.equal(search, theirs), f"{(search != theirs).sum()} of {x.numel()} differ"
    inside = x.abs() <= 1
    bounded = _testing.quantize8(x[inside].contiguous(), qmap, True, bounded=True)
    assert inside.sum() > x.numel() * 0.9
    assert torch.equal(bounded, fast[inside]), f"{(bounded != fast[inside]).sum()} differ"

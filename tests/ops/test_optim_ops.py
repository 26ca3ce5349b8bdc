"""Fused optimizer ops against torch.optim, several steps on fresh random data."""

from __future__ import annotations

import random
import re

import pytest
import torch
from cpu_tails import assert_equal_but_tails
from torch.library import opcheck

from leanddp import ops

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6  # float rounding (torch itself fuses some steps with FMA on CPU)
SIZES = [1, 2, 3, 5, 17, 31, 64, 1000, 1023, 4097, 70_003]


def _shapes(count):
    return [random.choice([(n,), (n, 3), (2, n, 1)]) for n in random.choices(SIZES, k=count)]


class _Problem:
    """Params, a torch optimizer over clones of them, and a stream of random gradients."""

    def __init__(self, device, count, grad_dtype=torch.float32):
        self.device, self.grad_dtype = device, grad_dtype
        self.params = [torch.randn(s, device=device) for s in _shapes(count)]
        self.ref = [p.clone().requires_grad_(True) for p in self.params]

    def new_grads(self, scale=1.0):
        """Fresh gradients for ours, and the same values (upcast, scaled) set on the reference."""
        grads = [torch.randn_like(p).to(self.grad_dtype) for p in self.params]
        for r, g in zip(self.ref, grads, strict=True):
            r.grad = g.float() * scale if scale != 1.0 else g.float()
        return grads

    def assert_close(self, states=(), exact=False):
        """Ours against torch's, to float rounding or (``exact``) bit for bit."""
        tol = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=RTOL, atol=ATOL)
        for ours, ref in zip(self.params, self.ref, strict=True):
            torch.testing.assert_close(ours, ref.detach(), **tol)
        for ours_list, ref_list in states:
            for ours, ref in zip(ours_list, ref_list, strict=True):
                torch.testing.assert_close(ours, ref, **tol)


ADAM_CONFIGS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True),
    dict(lr=1e-2, betas=(0.0, 0.9), eps=1e-3, weight_decay=0.1),
]


def _adam_kwargs(cfg, step):
    return dict(
        lr=cfg["lr"],
        beta1=cfg["betas"][0],
        beta2=cfg["betas"][1],
        eps=cfg["eps"],
        weight_decay=cfg["weight_decay"],
        step=step,
        maximize=cfg.get("maximize", False),
    )


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("cfg", ADAM_CONFIGS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adam_matches_torch(device, decoupled, cfg, grad_dtype):
    prob = _Problem(device, 9, grad_dtype)
    torch_cls, step_fn = (
        (torch.optim.AdamW, ops.adamw_step_) if decoupled else (torch.optim.Adam, ops.adam_step_)
    )
    ref_opt = torch_cls(prob.ref, foreach=False, **cfg)
    m = [torch.zeros_like(p) for p in prob.params]
    v = [torch.zeros_like(p) for p in prob.params]
    for step in range(1, STEPS + 1):
        grads = prob.new_grads()
        step_fn(prob.params, grads, m, v, **_adam_kwargs(cfg, step))
        ref_opt.step()
        prob.assert_close(
            [
                (m, [ref_opt.state[r]["exp_avg"] for r in prob.ref]),
                (v, [ref_opt.state[r]["exp_avg_sq"] for r in prob.ref]),
            ]
        )


def test_adamw_matches_torch_fused(device):
    """Also against torch's own fused kernel (the benchmark's anchor)."""
    prob = _Problem(device, 12)
    cfg = ADAM_CONFIGS[0]
    ref_opt = torch.optim.AdamW(prob.ref, fused=True, **cfg)
    m = [torch.zeros_like(p) for p in prob.params]
    v = [torch.zeros_like(p) for p in prob.params]
    for step in range(1, STEPS + 1):
        grads = prob.new_grads()
        ops.adamw_step_(prob.params, grads, m, v, **_adam_kwargs(cfg, step))
        ref_opt.step()
        prob.assert_close()


def test_adamw_on_flat_buffers_with_grad_scale(device):
    """The bucket case: one flat buffer per argument; grad_scale folds in an average."""
    prob = _Problem(device, 15)
    cfg = ADAM_CONFIGS[0]
    ref_opt = torch.optim.AdamW(prob.ref, foreach=False, **cfg)
    flat = torch.cat([p.reshape(-1) for p in prob.params])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    scale = 1.0 / random.choice([2, 3, 8])
    for step in range(1, STEPS + 1):
        grads = prob.new_grads(scale)
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        ops.adamw_step_(flat, flat_grad, m, v, grad_scale=scale, **_adam_kwargs(cfg, step))
        ref_opt.step()
    ref_flat = torch.cat([r.detach().reshape(-1) for r in prob.ref])
    torch.testing.assert_close(flat, ref_flat, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_param_copy_is_the_rounded_update(device, copy_dtype):
    prob = _Problem(device, 7, torch.bfloat16)
    m = [torch.zeros_like(p) for p in prob.params]
    v = [torch.zeros_like(p) for p in prob.params]
    copies = [torch.empty_like(p, dtype=copy_dtype) for p in prob.params]
    mom = [torch.empty_like(p) for p in prob.params]
    for step in range(1, 4):
        ops.adamw_step_(
            prob.params,
            prob.new_grads(),
            m,
            v,
            param_copy=copies,
            **_adam_kwargs(ADAM_CONFIGS[0], step),
        )
        for p, c in zip(prob.params, copies, strict=True):
            assert torch.equal(c, p.to(copy_dtype))
        ops.sgd_step_(
            prob.params,
            prob.new_grads(),
            mom,
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            nesterov=False,
            weight_decay=0.0,
            first_step=step == 1,
            param_copy=copies,
        )
        for p, c in zip(prob.params, copies, strict=True):
            assert torch.equal(c, p.to(copy_dtype))


def test_low_precision_conversions_are_exact_on_every_kind_of_value():
    """The CPU kernels' bf16/fp16 conversions against torch's, bit for bit, on random bit
    patterns (normals, subnormals, infinities, rounding ties) and NaN: with lr=0 the copy is the
    parameter rounded; with plain SGD at lr=1 from zero the parameter is minus the upcast
    gradient."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=gen)
    values = torch.cat([bits.view(torch.float32), torch.tensor([0.0, -0.0, 1.0 + 2**-8])])
    values[:64] = torch.tensor([float("inf"), float("-inf"), float("nan")]).repeat(22)[:64]
    for dtype in (torch.bfloat16, torch.float16):
        p = values.clone()
        copy = torch.empty_like(p, dtype=dtype)
        ops.sgd_step_(
            p, torch.zeros_like(p), None, param_copy=copy, lr=0.0, momentum=0.0, dampening=0.0,
            nesterov=False, weight_decay=0.0, first_step=True,
        )  # fmt: skip
        want = values.to(dtype)
        nan = values.isnan()
        assert copy[nan].isnan().all()
        assert torch.equal(copy[~nan].view(torch.int16), want[~nan].view(torch.int16)), dtype
        grads = bits.to(torch.int16).view(dtype)  # every 16-bit pattern class
        p = torch.zeros(grads.shape)
        ops.sgd_step_(
            p, grads, None, lr=1.0, momentum=0.0, dampening=0.0, nesterov=False,
            weight_decay=0.0, first_step=True,
        )  # fmt: skip
        finite = grads.isfinite()
        assert torch.equal(p[finite], -grads[finite].float()), dtype


SGD_CONFIGS = [
    dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
    dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.0, maximize=True),
    dict(lr=0.01, momentum=0.8, dampening=0.0, nesterov=True, weight_decay=5e-3),
]


@pytest.mark.parametrize("cfg", SGD_CONFIGS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_sgd_matches_torch(device, cfg, grad_dtype):
    """On the CPU bit for bit: each of torch's add(x, alpha=a) is one multiply-add in both (a
    last-bit difference grows over steps of training into one a tolerance cannot tell from a
    bug)."""
    prob = _Problem(device, 9, grad_dtype)
    ref_opt = torch.optim.SGD(prob.ref, foreach=False, **cfg)
    # NaN-filled: the first step must set the buffer from the gradient, never read it.
    bufs = [torch.full_like(p, float("nan")) for p in prob.params] if cfg["momentum"] else None
    for step in range(1, STEPS + 1):
        grads = prob.new_grads()
        ops.sgd_step_(prob.params, grads, bufs, first_step=step == 1, **cfg)
        ref_opt.step()
        states = (
            []
            if bufs is None
            else [(bufs, [ref_opt.state[r]["momentum_buffer"] for r in prob.ref])]
        )
        prob.assert_close(states, exact=device == "cpu")


def test_sgd_grad_scale_matches_scaled_gradients(device):
    prob = _Problem(device, 6)
    cfg = SGD_CONFIGS[1]
    ref_opt = torch.optim.SGD(prob.ref, foreach=False, **cfg)
    bufs = [torch.empty_like(p) for p in prob.params]
    for step in range(1, STEPS + 1):
        scale = random.uniform(0.1, 2.0)
        grads = prob.new_grads(scale)
        ops.sgd_step_(prob.params, grads, bufs, first_step=step == 1, grad_scale=scale, **cfg)
        ref_opt.step()
        prob.assert_close(exact=device == "cpu")


def test_empty_lists_and_empty_tensors(device):
    kw = _adam_kwargs(ADAM_CONFIGS[0], 1)
    ops.adamw_step_([], [], [], [], **kw)
    ops.sgd_step_([], [], None, **SGD_CONFIGS[0])
    with pytest.raises(ValueError, match="lr must be finite"):  # still validated
        ops.adamw_step_([], [], [], [], **(kw | dict(lr=-1.0)))
    e = torch.empty(0, device=device)
    ops.adamw_step_([e], [e.clone()], [e.clone()], [e.clone()], **kw)
    ops.sgd_step_([e], [e.clone()], None, **SGD_CONFIGS[0])
    # empty lists with device scalars (which pick the backend's kernel): nothing to step
    scalars = dict(
        amp_scale=torch.ones((), device=device), found_inf=torch.zeros((), device=device)
    )
    ops.adamw_step_([], [], [], [], **kw, **scalars)
    ops.sgd_step_([], [], None, **SGD_CONFIGS[0], **scalars)


def test_parallel_for_uses_all_threads():
    """The extension must be built with OpenMP, or at::parallel_for silently runs on one thread."""
    from leanddp._extension import _C

    assert _C._testing.parallel_threads() == torch.get_num_threads()


# --- bad input: a clear error naming the argument, and nothing written ----------------------


def _lists(device, n=3, size=6):
    return [[torch.randn(size, device=device) for _ in range(n)] for _ in range(4)]


def _assert_rejected(exc_type, match, fn, lists):
    before = [[t.clone() for t in lst] for lst in lists]
    with pytest.raises(exc_type, match=match):
        fn()
    for lst, b in zip(lists, before, strict=True):
        for t, o in zip(lst, b, strict=True):
            assert torch.equal(t, o), "a rejected call wrote to its arguments"


def _shared(a: str, b: str) -> str:
    """Message for two tensors sharing memory, in either order."""
    a, b = re.escape(a), re.escape(b)
    return rf"({a} and {b}|{b} and {a}) share memory"


def test_adam_bad_input(device):
    p, g, m, v = _lists(device)
    kw = _adam_kwargs(ADAM_CONFIGS[0], 1)
    all_ = [p, g, m, v]

    def run(**overrides):
        args = dict(params=p, grads=g, exp_avg=m, exp_avg_sq=v) | overrides
        return lambda: ops.adamw_step_(**args, **kw)

    _assert_rejected(
        ValueError,
        r"exp_avg\[1\] has 5 elements but params\[1\] has 6",
        run(exp_avg=[m[0], torch.zeros(5, device=device), m[2]]),
        all_,
    )
    _assert_rejected(
        ValueError, r"exp_avg_sq has 2 tensors but params has 3", run(exp_avg_sq=v[:2]), all_
    )
    if device == "cpu":  # (the CUDA kernel has no tail)
        _assert_rejected(
            ValueError,
            r"tail_from has 2 entries but params has 3",
            lambda: ops.adamw_step_(p, g, m, v, tail_from=[0, 0], **kw),
            all_,
        )
    _assert_rejected(
        TypeError, r"grads\[0\] has dtype Double", run(grads=[t.double() for t in g]), all_
    )
    _assert_rejected(
        TypeError,
        r"grads\[2\] has dtype BFloat16 but grads\[0\] has Float",
        run(grads=[g[0], g[1], g[2].bfloat16()]),
        all_,
    )
    _assert_rejected(
        TypeError,
        r"grads\[0\] has dtype Float but params are BFloat16",
        run(params=[t.bfloat16() for t in p]),
        all_,
    )
    _assert_rejected(
        TypeError, r"params\[0\] has dtype Double", run(params=[t.double() for t in p]), all_
    )
    _assert_rejected(
        TypeError, r"exp_avg\[1\] has dtype Half", run(exp_avg=[m[0], m[1].half(), m[2]]), all_
    )
    _assert_rejected(
        TypeError, r"param_copy\[0\] has dtype Float", run(param_copy=[t.clone() for t in p]), all_
    )
    strided = torch.randn(12, device=device)[::2]
    _assert_rejected(
        ValueError, r"params\[1\] must be contiguous", run(params=[p[0], strided, p[2]]), all_
    )
    _assert_rejected(
        ValueError,
        _shared("params[2]", "exp_avg[2]"),
        run(exp_avg=[m[0], m[1], p[2]]),
        all_,
    )
    # Across indices too: the same parameter twice, or a gradient that is another parameter.
    _assert_rejected(
        ValueError, _shared("params[0]", "params[2]"), run(params=[p[0], p[1], p[0]]), all_
    )
    _assert_rejected(
        ValueError, _shared("params[1]", "grads[0]"), run(grads=[p[1], g[1], g[2]]), all_
    )
    for name, value, match in [
        ("lr", -1.0, r"lr must be finite and >= 0"),
        ("beta1", 1.0, r"beta1 must be in \[0, 1\)"),
        ("beta2", -0.1, r"beta2 must be in \[0, 1\)"),
        ("eps", float("nan"), r"eps must be finite"),
        ("weight_decay", -0.1, r"weight_decay must be finite and >= 0"),
        ("step", 0, r"step must be >= 1"),
        ("grad_scale", float("inf"), r"grad_scale must be finite"),
    ]:
        bad = kw | {name: value}
        _assert_rejected(ValueError, match, lambda b=bad: ops.adamw_step_(p, g, m, v, **b), all_)
    if torch.cuda.is_available():
        other = "cpu" if device == "cuda" else "cuda"
        _assert_rejected(
            ValueError, r"grads\[1\] is on", run(grads=[g[0], g[1].to(other), g[2]]), all_
        )


def test_sgd_bad_input(device):
    p, g, b, _ = _lists(device)
    cfg = SGD_CONFIGS[1]
    all_ = [p, g, b]
    _assert_rejected(
        ValueError,
        r"nesterov needs momentum > 0 and dampening == 0",
        lambda: ops.sgd_step_(p, g, b, **(cfg | dict(nesterov=True, dampening=0.1))),
        all_,
    )
    _assert_rejected(
        ValueError,
        r"momentum_buffer must be empty when momentum is 0",
        lambda: ops.sgd_step_(p, g, b, **SGD_CONFIGS[0]),
        all_,
    )
    _assert_rejected(
        ValueError,
        r"momentum_buffer has 0 tensors but params has 3",
        lambda: ops.sgd_step_(p, g, None, **cfg),
        all_,
    )
    _assert_rejected(
        ValueError,
        r"momentum_buffer\[0\] has 4 elements",
        lambda: ops.sgd_step_(p, g, [torch.zeros(4, device=device)] + b[1:], **cfg),
        all_,
    )
    _assert_rejected(
        ValueError,
        r"lr must be finite",
        lambda: ops.sgd_step_(p, g, b, **(cfg | dict(lr=float("inf")))),
        all_,
    )


def test_opcheck(device):
    p, g, m, v = _lists(device, n=2, size=37)
    copies = [torch.empty_like(t, dtype=torch.bfloat16) for t in p]
    kw = dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        step=3,
        decoupled_weight_decay=True,
        maximize=False,
        grad_scale=0.5,
        state_steps=[],
    )
    opcheck(torch.ops.leanddp.adam_step_.default, (p, g, m, v, copies), kw)
    opcheck(
        torch.ops.leanddp.adam_step_.default,
        (p, [t.half() for t in g], m, v, []),
        kw | dict(decoupled_weight_decay=False, grad_scale=None),
    )
    # bf16 parameters with their state, and the device scalars of torch's fused optimizers.
    low = [[t.bfloat16() for t in lst] for lst in (p, g, m, v)]
    scalars = dict(
        lr_tensor=torch.tensor(1e-3, device=device),
        amp_scale=torch.tensor(4.0, device=device),
        found_inf=torch.zeros((), device=device),
    )
    steps = [torch.full((), 3.0, device=device) for _ in p]
    opcheck(
        torch.ops.leanddp.adam_step_.default, (*low, []), kw | scalars | dict(state_steps=steps)
    )
    skw = dict(
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=True,
        weight_decay=0.0,
        maximize=False,
        first_step=False,
        grad_scale=None,
    )
    opcheck(torch.ops.leanddp.sgd_step_.default, (p, g, m, copies), skw)
    opcheck(torch.ops.leanddp.sgd_step_.default, (*low[:3], []), skw | scalars)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_is_bit_identical_to_cpu(grad_dtype):
    """Both backends share the arithmetic and round alike (no FMA contraction on either), but
    in the tails the CPU steps as torch's scalar loop does (tests/support/cpu_tails.py)."""
    shapes = _shapes(8)
    cpu = [[torch.randn(s) for s in shapes] for _ in range(4)]  # params, m, v, momentum
    gpu = [[t.cuda() for t in lst] for lst in cpu]
    copies = [
        [torch.empty(s, dtype=torch.bfloat16, device=d) for s in shapes] for d in ("cpu", "cuda")
    ]
    for step in range(1, STEPS + 1):
        grads = [torch.randn(s).to(grad_dtype) for s in shapes]
        for (p, m, v, b), g, c in zip(
            (cpu, gpu), (grads, [t.cuda() for t in grads]), copies, strict=True
        ):
            ops.adamw_step_(
                p, g, m, v, param_copy=c, grad_scale=0.5, **_adam_kwargs(ADAM_CONFIGS[0], step)
            )
            ops.sgd_step_(p, g, b, first_step=step == 1, **SGD_CONFIGS[3])
    for lst_cpu, lst_gpu in zip(cpu + [copies[0]], gpu + [copies[1]], strict=True):
        for a, b in zip(lst_cpu, lst_gpu, strict=True):
            assert_equal_but_tails(a, b, torch.float32)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("lr_kind", ["float", "float32-tensor", "float64-tensor"])
def test_adam_with_step_tensors_matches_torch_fused(device, decoupled, lr_kind):
    """The scalars torch's fused Adam(W) reads from tensors: a step count per tensor (each its
    own), GradScaler's scale and found_inf, with the learning rate a float or a tensor. The
    kernels of both backends apply them through the same code (optim_math.h's apply_scalars),
    so this CPU case holds the CUDA kernel's arithmetic too; a float lr beside step tensors is
    GradScaler's usual case (with lr taken as 0 there, the weights would never move)."""
    cfg = ADAM_CONFIGS[0]
    prob = _Problem(device, 6)
    ref = [r.detach().clone() for r in prob.ref]
    m, v = ([torch.zeros_like(p) for p in prob.params] for _ in range(2))
    ref_m, ref_v = ([torch.zeros_like(p) for p in prob.params] for _ in range(2))
    first = [random.randint(0, 9) for _ in prob.params]  # each tensor's count so far
    steps = [torch.tensor(float(n), device=device) for n in first]
    ref_steps = [s.clone() for s in steps]
    scale = torch.tensor(4.0, device=device)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step_fn = ops.adamw_step_ if decoupled else ops.adam_step_
    dtype = torch.float64 if lr_kind == "float64-tensor" else torch.float32
    lr = cfg["lr"] if lr_kind == "float" else torch.tensor(cfg["lr"], dtype=dtype, device=device)
    for k in range(STEPS):
        skip = k == 2  # GradScaler found an inf: neither steps, and the counts stay
        found_inf = torch.tensor(float(skip), device=device)
        grads = [torch.randn_like(p) * 4.0 for p in prob.params]
        if not skip:  # torch's optimizer counts the step before the kernel; the scaler undoes it
            torch._foreach_add_(steps, 1.0)
            torch._foreach_add_(ref_steps, 1.0)
        hyper = dict(beta1=cfg["betas"][0], beta2=cfg["betas"][1], eps=cfg["eps"])
        hyper["weight_decay"] = cfg["weight_decay"]
        # (`step` is ignored: the step tensors replace it)
        step_fn(
            prob.params,
            grads,
            m,
            v,
            lr=lr,
            step=1,
            state_steps=steps,
            amp_scale=scale,
            found_inf=found_inf,
            **hyper,
        )
        fused(
            ref,
            [g.clone() for g in grads],
            ref_m,
            ref_v,
            [],
            ref_steps,
            lr=lr,
            **hyper,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
            found_inf=found_inf,
        )
        for ours, theirs in zip(prob.params + m + v, ref + ref_m + ref_v, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    moved = [not torch.equal(p, r.detach()) for p, r in zip(prob.params, prob.ref, strict=True)]
    assert all(moved), "the weights did not move"

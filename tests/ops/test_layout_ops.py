"""Fused optimizer ops on parameters in permuted dense layouts (channels_last, transposed): param,
grad and state share the strides and are stepped element by element in memory order, equal to
torch's optimizers on the same tensors; mismatched layouts are refused."""

from __future__ import annotations

import pytest
import torch

from leanddp import ops

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6


def _permuted_params(device):
    return [
        torch.randn(4, 3, 5, 6, device=device).contiguous(memory_format=torch.channels_last),
        torch.randn(9, 7, device=device).t(),
        torch.randn(5, 2, 3, device=device).permute(2, 0, 1),
        torch.randn(11, device=device),
    ]


def _grads_like(params):
    return [torch.randn_like(p) for p in params]  # randn_like keeps a dense tensor's strides


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_permuted_params_step_like_torch(device, kind):
    params = _permuted_params(device)
    assert all(not p.is_contiguous() for p in params[:3])
    ref = [p.clone().requires_grad_(True) for p in params]
    if kind == "adamw":
        cfg = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref, foreach=False, **cfg)
        states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    else:
        cfg = dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.01)
        ref_opt = torch.optim.SGD(ref, foreach=False, **cfg)
        states = [[torch.zeros_like(p) for p in params]]
    for step in range(1, STEPS + 1):
        grads = _grads_like(params)
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.clone()
        if kind == "adamw":
            ops.adamw_step_(
                params,
                grads,
                *states,
                lr=cfg["lr"],
                beta1=0.9,
                beta2=0.99,
                eps=cfg["eps"],
                weight_decay=cfg["weight_decay"],
                step=step,
            )
        else:
            ops.sgd_step_(params, grads, *states, first_step=step == 1, **cfg)
        ref_opt.step()
        keys = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        for i, (p, r) in enumerate(zip(params, ref, strict=True)):
            assert p.stride() == r.stride()
            torch.testing.assert_close(p, r.detach(), rtol=RTOL, atol=ATOL)
            for key, state in zip(keys, states, strict=True):
                torch.testing.assert_close(state[i], ref_opt.state[r][key], rtol=RTOL, atol=ATOL)


def test_layout_mismatch_is_refused(device):
    params = _permuted_params(device)[:2]
    grads = _grads_like(params)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    before = [p.clone() for p in params]
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    contiguous_grad = [grads[0], grads[1].contiguous()]
    with pytest.raises(ValueError, match=r"grads\[1\] must be laid out like params\[1\]"):
        ops.adamw_step_(params, contiguous_grad, m, v, **kwargs)
    contiguous_state = [m[0].contiguous(), m[1]]
    with pytest.raises(ValueError, match=r"exp_avg\[0\] must be laid out like params\[0\]"):
        ops.adamw_step_(params, grads, contiguous_state, v, **kwargs)
    gappy = torch.randn(9, 14, device=device)[:, ::2].t()  # transposed, with gaps
    with pytest.raises(ValueError, match=r"params\[1\] must be contiguous or dense"):
        ops.adamw_step_([params[0], gappy], grads, m, v, **kwargs)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b), "a rejected call wrote to its arguments"

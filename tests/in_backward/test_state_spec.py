"""The fused optimizer's rule for a parameter's state (``leanddp._C.state_spec``: whether the
kernels step it; its keys, dtype and device) against what really happens: the kernels accept
exactly the parameters the rule says they step, with as many state buffers as it names, and
after in-backward steps ``optimizer.state`` holds exactly its keys, in its dtype and on its
device, on the device and with offload_to_cpu (master weights included)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import leanddp
from leanddp import _C, ops

#: Parameters of every dtype and layout the rule distinguishes.
VARIETIES = {
    "float32": lambda: torch.randn(6, 5),
    "bfloat16": lambda: torch.randn(6, 5).bfloat16(),
    "float16": lambda: torch.randn(6, 5).half(),
    "float64": lambda: torch.randn(6, 5, dtype=torch.float64),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "transposed": lambda: torch.randn(5, 6).t(),
    "gappy": lambda: torch.randn(6, 10)[:, ::2],
}
#: (kind, whether the group has momentum)
KINDS = [("adam", False), ("sgd", True), ("sgd", False)]


def _step(kind: str, momentum: bool, param: torch.Tensor, state: list[torch.Tensor]) -> None:
    """One kernel step of ``param`` with the state buffers ``state`` (as many as passed)."""
    grad = torch.randn_like(param)
    if kind == "adam":
        hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
        ops.adam_step_([param], [grad], *[[s] for s in state], **hyper)
    else:
        hyper = dict(lr=0.1, momentum=0.9 if momentum else 0.0, dampening=0.0, nesterov=False)
        (buffer,) = [[s] for s in state] or [None]
        ops.sgd_step_([param], [grad], buffer, weight_decay=0.0, first_step=True, **hyper)


@pytest.mark.parametrize("kind,momentum", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(VARIETIES))
def test_the_kernels_step_what_the_rule_says(device, name, kind, momentum):
    param = VARIETIES[name]().to(device)
    spec = _C.state_spec(getattr(_C.OptimKind, kind), param, on_host=False, momentum=momentum)
    # the kind's buffers, from a parameter the kernels step whatever the rule says of `param`
    kind_spec = _C.state_spec(
        getattr(_C.OptimKind, kind), torch.zeros(1), on_host=False, momentum=momentum
    )
    assert kind_spec.stepped and kind_spec.counted == (kind == "adam")
    assert spec.dtype == param.dtype and spec.device == param.device
    state = [torch.zeros_like(param) for _ in kind_spec.buffers]  # (laid out like param)
    before = param.clone()
    try:
        _step(kind, momentum, param, state)
    except (ValueError, TypeError) as exc:
        assert not spec.stepped, f"{name}: the rule says stepped, the kernel refused: {exc}"
        assert spec.unfit in ("dtype", "layout") and spec.needs
        assert spec.keys == [], name
        return
    assert spec.stepped, f"{name}: the kernel stepped a parameter the rule says it cannot"
    assert not torch.equal(param, before), name
    assert spec.buffers == kind_spec.buffers and spec.unfit == "" and not spec.master
    assert spec.keys == (["step"] if kind == "adam" else []) + list(spec.buffers)


#: Sizes around torchao's 8-bit rule: at least 4096 elements and a multiple of the block (256).
SIZES_8BIT = {
    "4096": lambda: torch.randn(64, 64),
    "17 blocks": lambda: torch.randn(17, 256),
    "4100": lambda: torch.randn(4100),
    "4096 bfloat16": lambda: torch.randn(4096).bfloat16(),
    "8192 transposed": lambda: torch.randn(128, 64).t(),
}


@pytest.mark.parametrize("name", [*VARIETIES, *SIZES_8BIT])
def test_the_8bit_kernel_steps_what_the_rule_says(device, name):
    """The 8-bit kind's rule (torchao's AdamW8bit): 8-bit codes exactly for contiguous
    parameters of at least 4096 elements and a multiple of the block, plain moments in the
    parameter's dtype for the other contiguous ones; the 8-bit kernel steps each with that
    state, and refuses the dtypes the rule refuses."""
    from leanddp.optim import _lowbit

    pytest.importorskip("torchao.optim")
    param = {**VARIETIES, **SIZES_8BIT}[name]().to(device)
    spec = _C.state_spec(_C.OptimKind.adam8bit, param, on_host=False, momentum=False, block=256)
    fits = param.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert spec.stepped == (fits and param.is_contiguous()), name
    big = param.numel() >= 4096 and param.numel() % 256 == 0
    assert spec.quantized == (spec.stepped and big), name
    assert spec.dtype == (torch.uint8 if spec.quantized else param.dtype), name
    if spec.stepped:
        assert spec.keys == ["step", "exp_avg", "exp_avg_sq"] and spec.block == 256, name
    if spec.quantized:
        state = [torch.zeros(param.shape, dtype=torch.uint8, device=device) for _ in range(2)]
        scales = [torch.zeros(param.numel() // 256, device=device) for _ in range(2)]
    else:
        state = [torch.zeros_like(param) for _ in range(2)]
        scales = [torch.zeros(0, device=device) for _ in range(2)]
    before = param.clone()
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    args = ([param], [torch.randn_like(param)], [state[0]], [state[1]], [scales[0]], [scales[1]])
    try:
        ops.adam8bit_step_(*args, *_lowbit.qmaps(param.device), **hyper)
    except (ValueError, TypeError) as exc:
        assert not spec.stepped, f"{name}: the rule says stepped, the kernel refused: {exc}"
        return
    assert spec.stepped or spec.unfit == "layout", f"{name}: the kernel stepped a {param.dtype}"
    assert not torch.equal(param, before), name


def test_on_the_host():
    for name, make in VARIETIES.items():
        param = make()
        spec = _C.state_spec(_C.OptimKind.adam, param, on_host=True, momentum=False)
        # the host steps float32 masters through flat host buffers: contiguous parameters only
        fits = param.dtype in (torch.float32, torch.bfloat16, torch.float16)
        assert spec.stepped == (fits and param.is_contiguous()), name
        assert spec.dtype == torch.float32 and spec.device == torch.device("cpu"), name
        if spec.stepped:
            assert spec.master == (param.dtype != torch.float32), name
            master = ["master_weight"] if spec.master else []
            assert spec.keys == ["step", "exp_avg", "exp_avg_sq", *master], name
    with pytest.raises(TypeError):  # (the kind is typed: _C.OptimKind)
        _C.state_spec("adam", torch.zeros(1), on_host=False, momentum=False)


class Mixed(nn.Module):
    """float32, bfloat16 and float16 layers (one in channels_last), and, unless the host steps
    (offload_to_cpu, which takes only parameters the kernels step), a float64 one."""

    def __init__(self, offload: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.f32 = nn.Linear(4, 8)
        self.bf16 = nn.Linear(8, 8).bfloat16()
        self.f16 = nn.Linear(8, 8).half()
        self.f64 = None if offload else nn.Linear(8, 8).double()
        if offload:
            self.conv = self.conv.to(memory_format=torch.contiguous_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).mean((2, 3))
        x = self.f32(x)
        x = self.bf16(x.bfloat16()).float()
        x = self.f16(x.half()).float()
        if self.f64 is not None:
            x = self.f64(x.double()).float()
        return x


def _optimizer(params) -> torch.optim.Optimizer:
    params = list(params)
    # two groups: SGD keeps a momentum buffer in the first only
    return torch.optim.SGD(
        [{"params": params[::2]}, {"params": params[1::2], "momentum": 0.0}], lr=0.01, momentum=0.9
    )


def _state_as_the_rule_says(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    for factory in (_optimizer, lambda params: torch.optim.AdamW(params, lr=0.01)):
        for offload in (False, True):
            ddp = leanddp.DistributedDataParallel(
                Mixed(offload), optimizer_in_backward=factory, offload_to_cpu=offload
            )
            for _ in range(2):
                ddp(torch.randn(2, 3, 6, 6)).square().mean().backward()
            link = ddp._in_backward
            what = f"{type(ddp.optimizer).__name__} offload={offload}"
            for i, (name, p) in enumerate(zip(link.view.names, link.params, strict=True)):
                spec = link.view.spec(i)
                assert link.fused[i] == spec.stepped, f"{what} {name}"
                entry = ddp.optimizer.state[p]
                if not spec.stepped:  # torch's own state, from the per-bucket fallback
                    assert p.dtype == torch.float64, f"{what} {name}"
                    continue
                assert list(entry) == spec.keys, f"{what} {name}: {list(entry)}"
                for key in spec.buffers:
                    value = entry[key]
                    assert (value.dtype, value.device) == (spec.dtype, spec.device), (
                        f"{what} {name} {key}: {value.dtype} {value.device}"
                    )
                    if not offload:  # (laid out like the parameter)
                        assert value.stride() == p.stride(), f"{what} {name} {key}"
                if spec.master:
                    assert entry["master_weight"].dtype == torch.float32, f"{what} {name}"
            assert (link.fallback.calls > 0) == (not all(link.fused)), what


def test_optimizer_state_is_what_the_rule_says():
    run_ranks(1, _state_as_the_rule_says)

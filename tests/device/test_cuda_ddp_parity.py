"""leanddp on a GPU against torch's DDP (+ the same torch optimizer) in the same processes: NCCL
at world size 1, two gloo ranks sharing GPU 0, and a "cpu:gloo,cuda:nccl" group; gradient views
and no_sync accumulation, in-backward steps, comm hooks, the NaN check, sharded optimizer state,
a GradScaler (float lr), offload_to_cpu on bfloat16 + float32 parameters, and construction as
torch's DDP tutorial does it. What the host running ahead of the device shows (memory, host
synchronizations, events, pinned staging): test_cuda_ddp_async.py.

Run by benchmarks/gpu/run.sh (tests and compute-sanitizer); skipped where no GPU is visible.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from ddp_models import BATCH, Case, LockStep, Net, accumulate, assert_same, net_inputs
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep, assert_params_close
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

STEPS = 4


def _views(rank: int, world_size: int) -> None:
    """Gradient views and no_sync accumulation: gradients after every step (within 1e-5: GPU
    kernels may reduce with atomics, so bitwise equality is claimed on the CPU only)."""
    for accum, tiny in itertools.product((1, 3), (False, True)):
        case = Case(accum=accum, tiny_buckets=tiny, optimizer="adamw")
        run = LockStep(Net(rank=rank, f64=False).cuda(), case)
        for step in range(STEPS):
            run.backward(net_inputs(accum, "cuda"))
            for name, a, b in run.pairs():
                assert_same(a.grad, b.grad, f"{case} step {step} {name}.grad", exact=False)
            run.step()


def _in_backward(rank: int, world_size: int) -> None:
    """optimizer_in_backward: fused AdamW/SGD, the Python fallback, accumulation, tiny buckets."""
    for name, accum, tiny in itertools.product(
        ("adamw", "sgd-nesterov", "adagrad"), (1, 3), (False, True)
    ):
        cap = 0.0005 if tiny else None
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(), OPTIMIZERS[name], bucket_cap_mb=cap
        )
        for step in range(STEPS):
            run.step(net_inputs(accum, "cuda"), legacy_calls=step % 2 == 1)
            assert_params_close(run, f"cuda {name} accum={accum} tiny={tiny} step {step}")
        assert run.ours.memory_stats()["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT


def _mixed_backends(rank: int, world_size: int) -> None:
    """A default group of "cpu:gloo,cuda:nccl" is named neither gloo nor nccl as a whole:
    shard_optimizer_state reduce-scatters its CUDA buckets all the same (NCCL serves them), and
    allreduces CPU ones (gloo); then trains against torch on that group."""
    group = dist.group.WORLD
    scattered = _C._testing.reduces_scattered
    assert scattered(group, "cuda") and not scattered(group, "cpu")
    run = InBackwardLockStep(
        Net(rank=rank, f64=False).cuda(),
        OPTIMIZERS["adamw"],
        ours_kwargs=dict(shard_optimizer_state=True),
    )
    for step in range(STEPS):
        run.step(net_inputs(2, "cuda"))
        assert_params_close(run, f"cpu:gloo,cuda:nccl sharded step {step}")


def test_sharded_reduce_scatters_on_a_mixed_backend_group() -> None:
    run_ranks(1, _mixed_backends, backend="cpu:gloo,cuda:nccl", set_device=False)


def _sharded(rank: int, world_size: int) -> None:
    """shard_optimizer_state on the device and with offload_to_cpu: parameters within 1e-5 of
    torch's after every step, and the gathered state torch's optimizer's."""
    cases = itertools.product(("adamw", "sgd-nesterov"), (1, 3), (False, True), (False, True))
    for name, accum, tiny, offload in cases:
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(),
            OPTIMIZERS[name],
            offload=offload,
            bucket_cap_mb=0.0005 if tiny else None,
            ours_kwargs=dict(shard_optimizer_state=True),
        )
        what = f"cuda sharded {name} accum={accum} tiny={tiny} offload={offload}"
        for step in range(STEPS):
            run.step(net_inputs(accum, "cuda"), legacy_calls=step % 2 == 1)
            assert_params_close(run, f"{what} step {step}")
        saved = run.ours.optimizer.state_dict()["state"]
        for index, entry in run.ref_opt.state_dict()["state"].items():
            for key, value in entry.items():
                ours = saved[index][key].to(value.device)
                torch.testing.assert_close(ours, value, rtol=1e-5, atol=1e-6, msg=what)


def _with_hooks(rank: int, world_size: int) -> None:
    """A communication hook with optimizer_in_backward (its future is waited for on the side
    stream), against torch's DDP with the same hook + the same optimizer."""
    hooks = (default_hooks.allreduce_hook, default_hooks.bf16_compress_hook)
    for hook, accum in itertools.product(hooks, (1, 2)):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(), OPTIMIZERS["adamw"], bucket_cap_mb=0.0005
        )
        run.ref.register_comm_hook(None, hook)
        run.ours.register_comm_hook(None, hook)
        for step in range(STEPS):
            run.step(net_inputs(accum, "cuda"))
            assert_params_close(run, f"{hook.__name__} accum={accum} step {step}")


def _nan_checked_pair(rank: int, factory, check: bool | str):
    """torch's DDP + ``factory``'s optimizer, and leanddp stepping with ``factory`` inside
    backward under ``check_for_nan_in_grad=check``, from the same weights, tiny buckets."""
    model = Net(rank=rank, f64=False).cuda()
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group(), bucket_cap_mb=0.0005
    )
    ours = leanddp.DistributedDataParallel(
        copy.deepcopy(model),
        process_group=dist.new_group(),
        bucket_cap_mb=0.0005,
        optimizer_in_backward=factory,
        check_for_nan_in_grad=check,
    )
    return ref, factory(ref.module.parameters()), ours


def _strict(rank: int, world_size: int) -> None:
    """check_for_nan_in_grad="strict": every bucket is collected on the caller's stream at the
    end of backward, checked, then stepped on the side stream, which must follow that stream."""
    ref, ref_opt, ours = _nan_checked_pair(rank, OPTIMIZERS["adamw"], "strict")
    for step in range(STEPS):
        batches = net_inputs(2, "cuda")
        accumulate(ref, batches)
        ref_opt.step()
        ref_opt.zero_grad()
        accumulate(ours, batches)
        for (name, a), b in zip(
            ref.module.named_parameters(), ours.module.parameters(), strict=True
        ):
            torch.testing.assert_close(
                b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=f"{step} {name}": f"{n}: {m}"
            )


def _nan_on_the_device(rank: int, world_size: int) -> None:
    """check_for_nan_in_grad with in-backward steps on the device: a NaN in every bucket skips
    every step (the kernels read the check's flag; the host reads it once, at the end), Adam's
    step counts are taken back (on the device for fused AdamW, on the host for the plain one),
    and training goes on equal to torch's DDP + AdamW that never saw that batch."""
    for fused in (False, True):
        factory = functools.partial(torch.optim.AdamW, lr=1e-2, fused=fused)
        ref, ref_opt, ours = _nan_checked_pair(rank, factory, True)
        for step in range(STEPS):
            x = net_inputs(1, "cuda")[0]
            if step == 1:
                before = [p.detach().clone() for p in ours.module.parameters()]
                with pytest.raises(RuntimeError, match="check_for_nan_in_grad"):
                    (ours(x).square().mean() * float("nan")).backward()
                for p, b in zip(ours.module.parameters(), before, strict=True):
                    assert torch.equal(p, b), f"fused={fused}: a NaN step changed a weight"
                continue
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ours(x).square().mean().backward()
            pairs = zip(ref.module.named_parameters(), ours.module.parameters(), strict=True)
            for (name, a), b in pairs:
                torch.testing.assert_close(
                    b,
                    a,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=f"{fused} {step} {name}": f"{n}: {m}",
                )
                if not a.requires_grad:  # (Net's frozen layer: no state)
                    continue
                count, expected = ours.optimizer.state[b]["step"], ref_opt.state[a]["step"]
                assert float(count) == float(expected), f"fused={fused} {name}: step {count}"


def _grad_scaler(rank: int, world_size: int) -> None:
    """GradScaler with a float lr on the device: float32 parameters under float16 autocast,
    Adam and AdamW stepped inside backward, against torch's DDP + the same optimizer
    (fused=True) driven by its own GradScaler. The first two scales overflow (every bucket
    skipped: no weight moves, the step counts stay), then the weights move and follow torch's,
    with the same scale after every step. Catches the CUDA Adam kernel stepping with lr = 0 when
    it is given per-tensor device step counts (as under a GradScaler) and a float lr: the
    weights never moved. (float16 parameters: test_in_backward_lowp.py on the GPU.)

    Tolerance 1e-4: the two fused kernels round float32 differently in the last bit, and a
    weight whose float16 copy then rounds the other way changes later gradients at float16
    precision (2**-11), which Adam carries into the update at about lr * 2**-11 = 5e-6 per
    step; a lost or unscaled step is off by about lr = 1e-2."""
    scaler_kw = dict(init_scale=2.0**40, backoff_factor=2.0**-16, growth_interval=2)
    kw = dict(lr=1e-2, weight_decay=0.1)
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        model = Net(rank=rank, f64=False).cuda()
        ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group(), bucket_cap_mb=0.0005
        )
        ref_opt = cls(ref.module.parameters(), fused=True, **kw)
        scalers = [torch.amp.GradScaler("cuda", **scaler_kw) for _ in range(2)]
        ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model),
            process_group=dist.new_group(),
            bucket_cap_mb=0.0005,
            optimizer_in_backward=functools.partial(cls, **kw),
            grad_scaler=scalers[1],
        )
        trained = [(n, p) for n, p in ours.module.named_parameters() if p.requires_grad]
        start = [p.detach().clone() for _, p in trained]
        for step in range(6):
            x = net_inputs(1, "cuda")[0]
            opts = (ref_opt, ours.optimizer)
            for ddp, opt, scaler in zip((ref, ours), opts, scalers, strict=True):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = ddp(x).float().square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            what = f"{cls.__name__} step {step}"
            assert scalers[1].get_scale() == scalers[0].get_scale(), what
            if step < 2:  # 2**40, then 2**24: float16 overflows, torch skips the step
                assert scalers[0].get_scale() == scaler_kw["init_scale"] * 2.0 ** (-16 * (step + 1))
                for (name, p), b in zip(trained, start, strict=True):
                    assert torch.equal(p, b), f"{what}: an overflowing step changed {name}"
            pairs = zip(ref.module.named_parameters(), ours.module.parameters(), strict=True)
            for (name, a), b in pairs:
                torch.testing.assert_close(
                    b, a, rtol=1e-4, atol=1e-4, msg=lambda m, n=f"{what} {name}": f"{n}: {m}"
                )
                if a.requires_grad:
                    count, expected = ours.optimizer.state[b]["step"], ref_opt.state[a]["step"]
                    assert float(count) == float(expected), f"{what} {name}: step {count}"
        moved = {n: (p - b).abs().max().item() for (n, p), b in zip(trained, start, strict=True)}
        assert min(moved.values()) > 1e-3, f"{cls.__name__}: weights did not move: {moved}"
        assert ours._in_backward.fallback.calls == 0, cls.__name__


class _Mixed(nn.Module):
    """bfloat16 Linear layers around a float32 LayerNorm: a bucket per dtype, the float32 one
    ready between the two bfloat16 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 32).to(torch.bfloat16)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.a(x.to(torch.bfloat16))).float())
        return self.b(h.to(torch.bfloat16)).float()


def _offload_mixed_dtypes(rank: int, world_size: int) -> None:
    """offload_to_cpu on the GPU with bfloat16 and float32 parameters (a bucket each; float32
    masters on the host for the bfloat16 ones), with and without accumulation, several steps:
    each step against torch's DDP + AdamW stepping float32 masters, started from ours (the same
    weights, masters and moments, as test_offload.py's bfloat16 reference), so the gradients are
    the same bits and only the step is compared: masters, moments and step counts within
    float32 rounding, and each bfloat16 weight its master rounded to nearest. Catches staging,
    copies or masters that mix up the buckets' dtypes or offsets. (A free-running reference
    drifts: a weight whose bfloat16 rounding flips changes later gradients at 2**-8, which
    Adam's normalization turns into up to ~lr where a gradient is near zero.)"""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for accum in (1, 2):
        model = _Mixed().cuda()
        ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group()
        )
        masters = [p.detach().float().clone().requires_grad_() for p in ref.module.parameters()]
        ref_opt = factory(masters)
        ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model),
            process_group=dist.new_group(),
            device_ids=[0],
            optimizer_in_backward=factory,
            offload_to_cpu=True,
        )
        named = list(ours.module.named_parameters())
        for step in range(STEPS):
            with torch.no_grad():  # torch's side starts from ours
                for (_, p), r, m in zip(named, ref.module.parameters(), masters, strict=True):
                    r.copy_(p)
                    state = ours.optimizer.state.get(p) or {}
                    m.copy_(state.get("master_weight", p))
                    ref_opt.state[m] = {
                        k: v.clone() if k == "step" else v.to(m.device, copy=True)
                        for k, v in state.items()
                        if k != "master_weight"
                    }
            batches = net_inputs(accum, "cuda")
            accumulate(ref, batches)
            for m, r in zip(masters, ref.module.parameters(), strict=True):
                m.grad, r.grad = r.grad.float(), None
            ref_opt.step()
            accumulate(ours, batches)
            ours.synchronize()
            what = f"offload bf16 + fp32 accum={accum} step {step}"
            for (name, p), m in zip(named, masters, strict=True):
                state = ours.optimizer.state[p]
                master = state.get("master_weight", p.detach())
                if p.dtype == torch.bfloat16:
                    assert master.dtype == torch.float32 and master.device.type == "cpu", name
                    rounded = master.to(torch.bfloat16)
                    assert torch.equal(p.detach().cpu(), rounded), f"{what}: {name} vs master"
                else:
                    assert "master_weight" not in state, f"{what}: {name}"
                want = ref_opt.state[m]
                assert float(state["step"]) == float(want["step"]) == step + 1, f"{what} {name}"
                for key, got, expected in (
                    ("master", master, m.detach()),
                    ("exp_avg", state["exp_avg"], want["exp_avg"]),
                    ("exp_avg_sq", state["exp_avg_sq"], want["exp_avg_sq"]),
                ):
                    torch.testing.assert_close(
                        got.to(expected.device), expected, rtol=1e-5, atol=1e-7,
                        msg=lambda msg, n=f"{what} {name} {key}": f"{n}: {msg}",
                    )  # fmt: skip
        assert ours.memory_stats()["num_buckets"] >= 2


@pytest.mark.parametrize(
    "body",
    [
        _views,
        _in_backward,
        _with_hooks,
        _strict,
        _nan_on_the_device,
        _sharded,
        _grad_scaler,
        _offload_mixed_dtypes,
    ],
    ids=lambda f: f.__name__,
)
def test_nccl_world_size_1(body) -> None:
    run_ranks(1, body, backend="nccl")


@pytest.mark.parametrize("body", [_views, _in_backward, _sharded], ids=lambda f: f.__name__)
def test_two_gloo_ranks_sharing_the_gpu(body) -> None:
    run_ranks(2, body)


def _tutorial_pattern(rank: int, world_size: int) -> None:
    """torch's DDP tutorial: ``model.to(rank)``, ``device_ids=[rank]``, no
    ``torch.cuda.set_device``; every rank keeps cuda:0 current. Trains equal to torch's DDP."""
    assert torch.cuda.current_device() == 0
    device = torch.device("cuda", rank)
    model = Net(rank=rank, f64=False).to(device)
    ref_model = copy.deepcopy(model)
    ours = leanddp.DistributedDataParallel(model, device_ids=[rank])
    ref = torch.nn.parallel.DistributedDataParallel(ref_model, device_ids=[rank])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    for step in range(STEPS):
        x = torch.randn(BATCH, 12, device=device)
        for ddp, opt in zip((ours, ref), opts, strict=True):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert a.device == device
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_construction_without_set_device() -> None:
    run_ranks(2, _tutorial_pattern, backend="nccl", set_device=False)

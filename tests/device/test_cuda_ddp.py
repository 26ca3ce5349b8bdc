"""leanddp on a GPU, against torch's DDP (+ the same torch optimizer) in the same processes: NCCL
at world size 1, and two gloo ranks sharing GPU 0; with a GradScaler (float lr) and with
offload_to_cpu on bfloat16 + float32 parameters. Also what only a GPU shows: in-backward steps
ordered on a side stream keep gradient memory bounded by the window while the host runs ahead,
with a comm hook and across iterations never synchronized, and the training loop's hot path
never synchronizes the host with the device.

Run by benchmarks/gpu/run.sh (tests and compute-sanitizer); skipped where no GPU is visible.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, accumulate, assert_same
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, Deep, InBackwardLockStep, assert_params_close
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

STEPS = 4
BATCH = 6


def _batches(n: int) -> list[torch.Tensor]:
    return [torch.randn(BATCH, 12, device="cuda") for _ in range(n)]


def _views(rank: int, world_size: int) -> None:
    """Gradient views and no_sync accumulation: gradients after every step (within 1e-5: GPU
    kernels may reduce with atomics, so bitwise equality is claimed on the CPU only)."""
    for accum, tiny in itertools.product((1, 3), (False, True)):
        case = Case(accum=accum, tiny_buckets=tiny, optimizer="adamw")
        run = LockStep(Net(rank=rank, f64=False).cuda(), case)
        for step in range(STEPS):
            run.backward(_batches(accum))
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
            run.step(_batches(accum), legacy_calls=step % 2 == 1)
            assert_params_close(run, f"cuda {name} accum={accum} tiny={tiny} step {step}")
        assert run.ours.memory_stats()["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT


def _mixed_backends(rank: int, world_size: int) -> None:
    """A default group of "cpu:gloo,cuda:nccl" is named neither gloo nor nccl as a whole:
    shard_optimizer_state reduce-scatters its CUDA buckets all the same (NCCL serves them), and
    allreduces CPU ones (gloo); then trains against torch on that group."""
    group = dist.group.WORLD
    assert _C._reduces_scattered(group, "cuda") and not _C._reduces_scattered(group, "cpu")
    run = InBackwardLockStep(
        Net(rank=rank, f64=False).cuda(),
        OPTIMIZERS["adamw"],
        ours_kwargs=dict(shard_optimizer_state=True),
    )
    for step in range(STEPS):
        run.step(_batches(2))
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
            run.step(_batches(accum), legacy_calls=step % 2 == 1)
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
            run.step(_batches(accum))
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
        batches = _batches(2)
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
            x = _batches(1)[0]
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
            x = _batches(1)[0]
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
            batches = _batches(accum)
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


_WIDTH = 1024
_BATCH = 64
_LAYER = _WIDTH * _WIDTH * 4  # one bucket per layer of Deep(_WIDTH)
#: What one backward may hold: the window's released buckets, the bucket being filled and the
#: gradient being copied into it, activations (three per layer, generously), 1 MiB.
_BOUND = (_C.BUCKETS_IN_FLIGHT + 2) * _LAYER + 12 * _BATCH * _WIDTH * 4 * 3 + 2**20
_SLEEP = 200_000_000  # GPU cycles (~0.1 s): the host runs far ahead of the device
_HOOKS = [None, default_hooks.allreduce_hook]


def _hook_id(hook) -> str:
    return "builtin" if hook is None else hook.__name__


def _sleep_in_backward(grad: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(_SLEEP // 2)
    return grad


class _SlowDeep(Deep):
    """Deep that keeps the GPU busy at the start of each forward, and in backward before the
    gradients of its first two layers: their buckets (the last two) are reduced and stepped
    after that wait, so they are still queued on the device when backward returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(_SLEEP // 2)
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1 and x.requires_grad:
                x.register_hook(_sleep_in_backward)
        return x


def _deep_ddp(hook, slow: bool = False):
    """(Deep(_WIDTH) or _SlowDeep wrapped with a bucket per layer, fused AdamW inside backward and
    ``hook`` as its comm hook; an input). Past the bucket rebuild and the state's creation."""
    model = (_SlowDeep if slow else Deep)(_WIDTH).cuda()
    ddp = leanddp.DistributedDataParallel(
        model,
        device_ids=[0],
        bucket_cap_mb=_LAYER / 2**20,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
    )
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    x = torch.randn(_BATCH, _WIDTH, device="cuda")
    for _ in range(3):
        ddp(x).square().mean().backward()
    return ddp, x


def _idle() -> tuple[int, int]:
    """Waits for the device and for the caching allocator to take back what the streams are
    done with; resets the peaks. Returns the (active, allocated) bytes now."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (also processes the events of blocks freed on other streams)
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    return stats["active_bytes.all.current"], stats["allocated_bytes.all.current"]


def _peaks(ddp, start: tuple[int, int], what: str) -> int:
    """Checks the peaks since ``_idle()`` returned ``start`` against the window: "active" bytes
    count a freed block until the streams it was recorded on are past it (the device's
    footprint; allocated bytes drop at the free, before the side stream's step has run), and
    the Reducer's own count of the last backward. Returns the active peak."""
    torch.cuda.synchronize()
    active = torch.cuda.memory_stats()["active_bytes.all.peak"] - start[0]
    allocated = torch.cuda.max_memory_allocated() - start[1]
    stats = ddp.memory_stats()
    info = (what, active / _LAYER, allocated / _LAYER, _BOUND / _LAYER, stats)
    assert active <= _BOUND and allocated <= _BOUND, info
    assert stats["peak_bucket_bytes"] <= (_C.BUCKETS_IN_FLIGHT + 1) * _LAYER, info
    assert stats["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, info
    assert all(p.grad is None for p in ddp.module.parameters()), what
    return active


def _memory(rank: int, world_size: int, hook) -> None:
    """The host runs ahead of the GPU (a slow kernel queued first): gradient memory during
    backward stays within the window, not every bucket (as when steps waited for the host to see
    reductions complete), with a comm hook too (its future waited for on the side stream; a
    hook whose buckets were stepped only at the end of backward would hold them all)."""
    ddp, x = _deep_ddp(hook)
    for i in range(3):
        start = _idle()
        torch.cuda._sleep(_SLEEP)  # the GPU is busy for a while: the host runs far ahead
        ddp(x).square().mean().backward()
        _peaks(ddp, start, f"{_hook_id(hook)} iteration {i}")


@pytest.mark.parametrize("hook", _HOOKS, ids=_hook_id)
def test_gradient_memory_bounded_while_the_host_runs_ahead(hook) -> None:
    run_ranks(1, _memory, hook, backend="nccl")


def _memory_across_iterations(rank: int, world_size: int, hook) -> None:
    """Iterations with no synchronization between them, the GPU slowed in every forward and
    backward: each backward returns with its last two buckets' steps still queued on the device,
    and the host runs into the next backward, whose buckets cannot reuse that memory yet. The
    window must count them: the peak over the whole run stays that of one backward started
    from an idle device (a window that starts empty at every backward holds two more buckets).
    max_memory_allocated alone cannot see this (a block freed on the host no longer counts
    though the side stream still uses it): "active" bytes do."""
    ddp, x = _deep_ddp(hook, slow=True)
    start = _idle()
    ddp(x).square().mean().backward()
    one = _peaks(ddp, start, "one backward")
    start = _idle()
    behind = []
    for _ in range(4):
        ddp(x).square().mean().backward()
        behind.append(not torch.cuda.current_stream().query())  # (a query, not a wait)
    many = _peaks(ddp, start, f"{_hook_id(hook)}: 4 iterations")
    assert all(behind), "the device kept up: this test would not see the previous steps"
    assert many <= one + _LAYER // 2, (many / _LAYER, one / _LAYER)


@pytest.mark.parametrize("hook", _HOOKS, ids=_hook_id)
def test_gradient_memory_bounded_across_unsynchronized_iterations(hook) -> None:
    run_ranks(1, _memory_across_iterations, hook, backend="nccl")


def _hook_overlap(rank: int, world_size: int) -> None:
    """torch's allreduce_hook on NCCL, the GPU slowed so that the host runs ahead: a bucket's
    storage comes from the recycler, but never that of the bucket launched just before it while
    that bucket's step is not known finished (its collective would then be waited for by the
    compute stream): two collectives overlap backward, not one."""
    ddp, x = _deep_ddp(default_hooks.allreduce_hook, slow=True)
    for i in range(3):
        ddp(x).square().mean().backward()
        reuses = ddp.reducer._recycler_reuses()
        what = f"iteration {i}: (bucket, reused bucket, waits) {reuses}"
        assert len(reuses) >= len(ddp.module.layers) - 3, what  # (at most 3 buffers new)
        assert all(not waits or bucket - giver >= 2 for bucket, giver, waits in reuses), what
        assert ddp.memory_stats()["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, what


def test_cuda_comm_hook_overlaps_two_collectives() -> None:
    run_ranks(1, _hook_overlap, backend="nccl")


def _end_of_backward(rank: int, world_size: int) -> None:
    """The modes that step every bucket at the end of backward (unused parameters searched for,
    the strict NaN check, sharded clipping): over 20 iterations, no new CUDA event after the
    first few and never more buckets in flight than there are buckets."""
    modes = {
        "find_unused_parameters": dict(find_unused_parameters=True),
        "strict": dict(check_for_nan_in_grad="strict"),
        "sharded clipped": dict(shard_optimizer_state=True, max_grad_norm=1.0),
    }
    for name, kwargs in modes.items():
        ddp = leanddp.DistributedDataParallel(
            Net(unused=name == "find_unused_parameters", rank=rank, f64=False).cuda(),
            device_ids=[0], bucket_cap_mb=0.0005,
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3), **kwargs,
        )  # fmt: skip
        created = []
        for _ in range(20):
            ddp(_batches(1)[0]).square().mean().backward()
            stats = ddp.memory_stats()
            assert stats["max_buckets_in_flight"] <= stats["num_buckets"], (name, stats)
            created.append(ddp.reducer.events_created())
        assert len(set(created[3:])) == 1, (name, created)


def test_cuda_end_of_backward_steps_do_not_pile_up() -> None:
    run_ranks(1, _end_of_backward, backend="nccl")


def _sync_free(rank: int, world_size: int, config: str) -> None:
    """Training steps under torch.cuda.set_sync_debug_mode("error"): any host synchronization
    on leanddp's hot path (forward glue, hooks, launches, in-backward steps, offload copies)
    raises. Each configuration with one micro-batch per step and with two (the first under
    no_sync), with the built-in reduction and with torch's allreduce_hook (not "sharded", which
    refuses hooks). With check_for_nan_in_grad ("nan_check"), exactly one synchronization per
    synchronized backward: the read of the check's device flags at its end, with offload_to_cpu
    too ("offload_nan_check": the flags set on its device-to-host stream). "fp16_scaler":
    fp16 parameters stepped by the fused kernels under a GradScaler, with a tensor lr.
    "sharded": shard_optimizer_state (reduce-scatter, step, all-gather, all ordered on the side
    stream)."""
    hooks = [None] if config == "sharded" else _HOOKS
    for accum, hook in itertools.product((1, 2), hooks):
        _sync_free_steps(rank, config, accum, hook)


def _sync_free_steps(rank: int, config: str, accum: int, hook) -> None:
    what = f"{config} accum={accum} hook={_hook_id(hook)}"
    fused = config in ("in_backward", "fp16_scaler", "sharded")  # nan_check: counts on the host
    lr = torch.tensor(1e-3, device="cuda") if config == "fp16_scaler" else 1e-3
    factory = functools.partial(torch.optim.AdamW, lr=lr, fused=fused)
    kwargs = dict(device_ids=[0], bucket_cap_mb=0.0005)
    if config != "views":
        kwargs["optimizer_in_backward"] = factory
    if config in ("offload", "offload_nan_check"):
        kwargs["offload_to_cpu"] = True
    if config == "sharded":
        kwargs["shard_optimizer_state"] = True
    if config in ("nan_check", "offload_nan_check"):
        kwargs["check_for_nan_in_grad"] = True
    model = Net(rank=rank, f64=False).cuda()
    scaler = None
    if config == "fp16_scaler":  # (Net's forward goes back to float32 after its float64 layer)
        model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3)).cuda().half()
        scaler = kwargs["grad_scaler"] = torch.amp.GradScaler("cuda")
    ddp = leanddp.DistributedDataParallel(model, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    batches = [b.to(next(model.parameters()).dtype) for b in _batches(accum)]

    def backward(x: torch.Tensor) -> None:
        loss = ddp(x).float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()

    def step() -> None:
        for x in batches[:-1]:
            with ddp.no_sync():
                backward(x)
        backward(batches[-1])
        if scaler:
            scaler.step(ddp.optimizer)
            scaler.update()
        if config == "views":
            for p in ddp.module.parameters():
                p.grad = None

    for _ in range(3):  # the bucket rebuild (a broadcast read on the host) happens here
        step()
    torch.cuda.synchronize()
    expected = 3 if config.endswith("nan_check") else 0
    torch.cuda.set_sync_debug_mode("error" if expected == 0 else "warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == expected, (what, [str(w.message) for w in syncs])
    if config == "fp16_scaler":
        assert ddp._in_backward.fallback.calls == 0, what


@pytest.mark.parametrize(
    "config",
    ["views", "in_backward", "offload", "nan_check", "offload_nan_check", "fp16_scaler", "sharded"],
)
def test_no_host_synchronization_per_iteration(config: str) -> None:
    run_ranks(1, _sync_free, config, backend="nccl")


def _pinned_staging_only(rank: int, world_size: int) -> None:
    """offload_to_cpu pins only what crosses PCIe: the gradient and weight staging buffers. The
    optimizer state and bfloat16 parameters' float32 masters are ordinary host memory."""
    for dtype in (torch.float32, torch.bfloat16):
        ddp = leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False).to("cuda", dtype),
            device_ids=[0],
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
            offload_to_cpu=True,
        )
        for _ in range(2):
            ddp(torch.randn(BATCH, 12, device="cuda", dtype=dtype)).float().sum().backward()
        ddp.synchronize()
        stats = ddp.memory_stats()
        if dtype == torch.float32:  # the float32 masters are the copy-back staging buffer
            staging = stats["host_master_bytes"] + stats["host_buffer_bytes"]
        else:
            staging = stats["host_buffer_bytes"]
        assert stats["host_pinned_bytes"] == staging > 0, (dtype, stats)
        for entry in ddp.optimizer.state.values():  # state, and bfloat16's master_weight
            for key, value in entry.items():
                assert value.device.type != "cpu" or not value.is_pinned(), (dtype, key)


def test_offload_pins_only_staging_buffers() -> None:
    run_ranks(1, _pinned_staging_only, backend="nccl")


def _offload_gpu_lr(rank: int, world_size: int) -> None:
    """offload_to_cpu's host steps read the learning rate in host memory: a tensor lr on the
    GPU (which they could read only by synchronizing at every forward) is refused at
    construction, naming lr."""
    lr = torch.tensor(1e-3, device="cuda")
    with pytest.raises(ValueError, match="tensor lr must be on the CPU"):
        leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False).cuda(),
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=lr),
            offload_to_cpu=True,
        )


def test_offload_refuses_a_gpu_tensor_lr() -> None:
    run_ranks(1, _offload_gpu_lr, backend="nccl")


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


@pytest.mark.parametrize("offload", [False, True], ids=["in_backward", "offload_accumulating"])
def test_events_are_pooled(offload: bool) -> None:
    """Steps and copies reuse a bounded set of CUDA events, not one per bucket per iteration;
    with offload_to_cpu and accumulation, the host accumulator's copies too (counted with the
    rest)."""
    run_ranks(1, _events, offload, backend="nccl")


def _events(rank: int, world_size: int, offload: bool) -> None:
    ddp = leanddp.DistributedDataParallel(
        Net(rank=rank, f64=False).cuda(),
        device_ids=[0],
        bucket_cap_mb=0.0005,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
        offload_to_cpu=offload,
    )

    def step() -> None:
        if offload:  # a no_sync() micro-batch first: the accumulator's copies and events
            with ddp.no_sync():
                ddp(_batches(1)[0]).square().mean().backward()
        ddp(_batches(1)[0]).square().mean().backward()

    for _ in range(3):
        step()
    created = ddp.reducer.events_created()
    if offload:
        ddp.synchronize()
        assert created > 0, "the offload copies recorded no event"
    for _ in range(5):
        step()
    assert ddp.reducer.events_created() == created, "new events were created per iteration"
    assert dist.get_world_size() == 1

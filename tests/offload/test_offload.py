"""offload_to_cpu against torch's DDP followed by the same torch optimizer (and
clip_grad_norm_), on random data in the same processes: parameters after every step within 1e-5
relative, with accumulation, an LR scheduler, parameter groups and tiny buckets. Also: where
the state lives, bfloat16 parameters with float32 masters against a float64 reference, many
steps with one parameter per bucket and no explicit synchronization, errors met by the host
worker, and teardown with host work in flight.

On this CPU-only machine the pipeline is the GPU one with synchronous copies: the same worker
thread, queue, staging buffers, masters and waits.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from ddp_models import Net, accumulate
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep, assert_params_close
from torch import nn

import leanddp

STEPS = 4
BATCH = 6
LEANDDP_PATHS = pytest.mark.leanddp_paths  # cases CI runs in its first step only (pyproject.toml)


def _train(run: InBackwardLockStep, what: str, accum: int, steps: int = STEPS) -> int:
    """Trains both ``steps`` steps, comparing after each; returns how many steps clipped."""
    clipped = 0
    for step in range(steps):
        # torch's DDP asserts when a static graph's first iteration runs under no_sync
        n = 1 if run.ref.static_graph and step == 0 else accum
        run.step([torch.randn(BATCH, 12) for _ in range(n)], legacy_calls=step % 2 == 1)
        assert_params_close(run, f"{what} step {step}")  # read through state_dict(): waits
        for p in run.ours.module.parameters():
            assert p.grad is None, f"{what} step {step}: a gradient survived the host step"
        assert run.ours.memory_stats()["bucket_bytes"] == 0, f"{what}: buckets not released"
        if run.max_grad_norm is not None:
            norm = run.ours.offload_stats()["grad_norm"]
            assert norm == pytest.approx(run.ref_norm, rel=1e-5), f"{what} step {step}: norm"
            clipped += run.ref_norm > run.max_grad_norm
    return clipped


def _parity(rank: int, world_size: int, names: list[str], max_grad_norm: float | None) -> None:
    for name, accum, tiny in itertools.product(names, (1, 3), (False, True)):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False),
            OPTIMIZERS[name],
            offload=True,
            max_grad_norm=max_grad_norm,
            bucket_cap_mb=0.0005 if tiny else None,
        )
        clipped = _train(run, f"{name} accum={accum} tiny={tiny} clip={max_grad_norm}", accum)
        if max_grad_norm is not None:  # 0.05 clips every step, 1e3 none
            assert clipped == (STEPS if max_grad_norm < 1 else 0), clipped
        stats = run.ours.offload_stats()
        assert stats["iterations"] == STEPS and stats["buckets"] >= STEPS
        for _ in range(10):  # the worker is idle (the state was read): nothing is waited for
            run.ours.synchronize()
        assert run.ours.offload_stats()["wait_seconds"] == stats["wait_seconds"], "counted"


@pytest.mark.parametrize(
    "names,max_grad_norm",
    [
        pytest.param(["sgd-nesterov", "sgd-dampening", "sgd-plain"], None, marks=LEANDDP_PATHS),
        (["adam", "adamw"], None),
        pytest.param(["adamw-groups", "sgd-groups"], None, marks=LEANDDP_PATHS),
        pytest.param(["adamw", "sgd-nesterov"], 0.05, marks=LEANDDP_PATHS),  # clips every step
        (["adamw-groups"], 1e3),  # never clips: the coefficient is 1
    ],
    ids=["sgd", "adam", "groups", "clipped", "clip-inactive"],
)
def test_parity_with_torch_ddp_and_optimizer(names: list[str], max_grad_norm: float | None) -> None:
    run_ranks(2, _parity, names, max_grad_norm)


def _unused(rank: int, world_size: int) -> None:
    for kwargs in (dict(find_unused_parameters=True), dict(static_graph=True)):
        run = InBackwardLockStep(
            Net(unused=True, rank=rank, f64=False),
            OPTIMIZERS["adamw"],
            offload=True,
            max_grad_norm=0.05,
            **kwargs,
        )
        _train(run, f"unused {kwargs}", accum=2)
        assert run.ours.module.never.weight not in run.ours.optimizer.state


def test_unused_parameters_and_static_graph() -> None:
    """Globally unused parameters are not stepped and get no state; clipping sums what torch's
    clip_grad_norm_ sees (steps wait for the end of backward there)."""
    run_ranks(2, _unused)


def _comm_hook(rank: int, world_size: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    run = InBackwardLockStep(
        Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True, max_grad_norm=0.05,
        bucket_cap_mb=0.0005,
    )  # fmt: skip
    for ddp in (run.ref, run.ours):
        ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
    _train(run, "adamw + clipping with torch's allreduce_hook", accum=2)


def test_with_comm_hook() -> None:
    """A communication hook's result (a future) is what goes to the host."""
    run_ranks(2, _comm_hook)


# ------------------------------------------------------------------------------------------
# where things live


def _placement(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True)
    _train(run, "placement", accum=1, steps=2)
    ours = run.ours
    stats = ours.memory_stats()
    params = [p for p in ours.module.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert stats["param_bytes"] == param_bytes
    steps = 4 * len(params)  # one float32 step counter per parameter
    assert stats["optimizer_state_bytes"] == 2 * param_bytes + steps
    assert stats["host_master_bytes"] == param_bytes  # float32 parameters: a host copy each
    assert stats["host_buffer_bytes"] == param_bytes  # staging for every bucket's gradients
    assert stats["bucket_bytes"] == 0 and stats["grad_bytes"] == 0
    for entry in ours.optimizer.state.values():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}  # torch's keys for float32
        for value in entry.values():
            assert value.device.type == "cpu"
    numel = sum(p.numel() for p in params)
    per_param = stats["host_bytes_per_param"]
    assert per_param == {
        "optimizer_state": 8 + steps / numel,
        "master_weights": 4.0,  # the copy-back staging buffer is the float32 master
        "staging": 4.0,  # the gradients' staging buffer
        "accumulation": 0.0,  # no no_sync() micro-batch yet
        "pinned": 0.0,  # nothing is pinned without a GPU
    }, per_param
    # bfloat16 parameters: float32 masters in a block of their own, bfloat16 staging both ways
    low_model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3)).to(torch.bfloat16)
    low_numel = sum(p.numel() for p in low_model.parameters())
    low = leanddp.DistributedDataParallel(
        low_model,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
        offload_to_cpu=True,
    )
    for _ in range(2):
        low(torch.randn(4, 12, dtype=torch.bfloat16)).float().square().mean().backward()
    low.synchronize()
    per_param = low.memory_stats()["host_bytes_per_param"]
    assert per_param == {
        "optimizer_state": 8 + 4 * 4 / low_numel,  # float32 state and step counters
        "master_weights": 4.0,
        "staging": 4.0,  # bfloat16 gradients in, bfloat16 weights out
        "accumulation": 0.0,
        "pinned": 0.0,
    }, per_param


def test_state_and_masters_are_on_the_host() -> None:
    run_ranks(2, _placement)


# ------------------------------------------------------------------------------------------
# bfloat16 parameters with float32 masters


class LowPrecisionNet(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 12)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float()


def _adamw64(master, grad, m, v, step: int, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1):
    """One AdamW step in float64, as torch.optim.AdamW defines it."""
    master = master * (1 - lr * wd)
    m = betas[0] * m + (1 - betas[0]) * grad
    v = betas[1] * v + (1 - betas[1]) * grad * grad
    denom = (v.sqrt() / (1 - betas[1] ** step) ** 0.5) + eps
    return master - lr / (1 - betas[0] ** step) * m / denom, m, v


def _low_precision(rank: int, world_size: int, dtype: torch.dtype, device: str = "cpu") -> None:
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    model = LowPrecisionNet(dtype).to(device)
    max_norm = 0.05  # clips every step
    ours = leanddp.DistributedDataParallel(
        model, process_group=dist.new_group(), optimizer_in_backward=factory,
        offload_to_cpu=True, bucket_cap_mb=0.0005, max_grad_norm=max_norm,
    )  # fmt: skip
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group()
    )
    params = list(ours.module.parameters())
    for step in range(1, 6):
        # The float64 reference starts from our state before this step and takes torch's
        # low-precision gradients of the same weights (so only the step itself is compared),
        # clipped in float64 as clip_grad_norm_ defines it.
        state = ours.optimizer.state
        before = []
        for p in params:
            s = state.get(p)
            if s is None:
                before.append((p.double(), torch.zeros_like(p, dtype=torch.float64), None))
                continue
            m, v = s["exp_avg"].double(), s["exp_avg_sq"].double()
            before.append((s["master_weight"].double(), m, v))
        with torch.no_grad():
            for a, b in zip(ref.module.parameters(), params, strict=True):
                a.copy_(b)
                a.grad = None
        batches = [torch.randn(BATCH, 12, device=device) for _ in range(2)]
        for ddp in (ref, ours):
            accumulate(ddp, batches)
        ours.synchronize()
        norm = torch.stack([r.grad.double().square().sum() for r in ref.parameters()]).sum().sqrt()
        assert ours.offload_stats()["grad_norm"] == pytest.approx(norm.item(), rel=1e-6)
        coef = min(max_norm / (norm.item() + 1e-6), 1.0)
        assert coef < 1
        for (name, p), (master, m, v), r in zip(
            ours.module.named_parameters(), before, ref.module.parameters(), strict=True
        ):
            v = torch.zeros_like(m) if v is None else v
            master, m, v = master.cpu(), m.cpu(), v.cpu()
            want, want_m, want_v = _adamw64(master, r.grad.double().cpu() * coef, m, v, step)
            got = ours.optimizer.state[p]
            assert got["master_weight"].dtype == torch.float32
            # float32 arithmetic: ~10 roundings of 6e-8 relative in the update (of size ~lr),
            # and the master's own rounding (6e-8 relative).
            torch.testing.assert_close(
                got["master_weight"].double(), want, rtol=2e-7, atol=1e-7,
                msg=lambda msg, n=name, k=step: f"step {k} master of {n}: {msg}",
            )  # fmt: skip
            torch.testing.assert_close(got["exp_avg"].double(), want_m, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(got["exp_avg_sq"].double(), want_v, rtol=1e-6, atol=1e-12)
            # The low-precision weight is the float32 master rounded to nearest, in one kernel.
            assert torch.equal(p.detach().cpu(), got["master_weight"].to(dtype)), name
            # The master holds what the low-precision weight cannot.
            assert not torch.equal(got["master_weight"], p.detach().float().cpu()), name
    saved = ours.optimizer.state_dict()
    assert all("master_weight" in entry for entry in saved["state"].values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_parameters_with_float32_masters_against_float64(dtype) -> None:
    """bf16/fp16 parameters, float32 masters on the host, clipping: each step against the same
    step in float64 from the same state. Tolerance: the float32 update rounds ~10 times at 6e-8
    relative (on a step of size ~lr = 1e-2), and the master itself at 6e-8 of |w| (< 1): within
    rtol 2e-7 + atol 1e-7."""
    run_ranks(2, _low_precision, dtype)


# ------------------------------------------------------------------------------------------
# on a GPU (two gloo ranks sharing GPU 0): the copy stream, events and pinned host memory


def _cuda(rank: int, world_size: int) -> None:
    for name, clip, accum in itertools.product(("adamw", "sgd-nesterov"), (None, 0.05), (1, 3)):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(), OPTIMIZERS[name], offload=True,
            max_grad_norm=clip, device_ids=[0], bucket_cap_mb=0.0005,
        )  # fmt: skip
        what = f"cuda {name} clip={clip} accum={accum}"
        for step in range(STEPS):
            run.step([torch.randn(BATCH, 12, device="cuda") for _ in range(accum)])
            assert_params_close(run, f"{what} step {step}")
        # The state is ordinary host memory; only the staging buffers that cross PCIe are
        # pinned (what exactly is pinned:
        # test_cuda_ddp_async.py::test_offload_pins_only_staging_buffers).
        for entry in run.ours.optimizer.state.values():
            for key, value in entry.items():
                assert value.device.type == "cpu" and not value.is_pinned(), (what, key)
        assert run.ours.memory_stats()["host_pinned_bytes"] > 0, what
    _low_precision(rank, world_size, torch.bfloat16, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_parity_and_bf16_on_a_shared_gpu() -> None:
    run_ranks(2, _cuda)


# ------------------------------------------------------------------------------------------
# races, errors, teardown


def _many_steps(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(
        Net(rank=rank, f64=False),
        OPTIMIZERS["adamw"],
        offload=True,
        max_grad_norm=0.5,
        bucket_cap_mb=1e-6,  # one parameter per bucket: the most hand-offs
        offload_threads=1,
    )
    x_check = torch.randn(BATCH, 12)
    for step in range(40):
        run.step([torch.randn(BATCH, 12) for _ in range(1 + step % 3)])
        # No explicit wait: the forward itself must wait for the host steps.
        with torch.no_grad():
            for ddp in (run.ref, run.ours):
                ddp.eval()
            torch.testing.assert_close(run.ours(x_check), run.ref(x_check), rtol=1e-5, atol=1e-6)
            for ddp in (run.ref, run.ours):
                ddp.train()
    assert run.ours.offload_stats()["iterations"] == 40


@pytest.mark.leanddp_paths
def test_many_steps_tiny_buckets_no_explicit_wait() -> None:
    run_ranks(2, _many_steps)


def _load_in_flight(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(
        Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=1e-6
    )
    for _ in range(2):
        run.step([torch.randn(BATCH, 12)])
    run.step([torch.randn(BATCH, 12)])  # ours: host steps possibly still running
    new = {
        k: torch.randn_like(v) if v.is_floating_point() else v
        for k, v in run.ref.module.state_dict().items()
    }
    run.ref.module.load_state_dict(new)
    run.ours.module.load_state_dict(new)  # waits, then writes: the worker cannot overwrite it
    for name, a, b in run.pairs():  # (tied weights: both loaded the same last value)
        assert torch.equal(b.detach(), a.detach()), name
    for step in range(2):  # the masters are refreshed from the loaded weights
        run.step([torch.randn(BATCH, 12)])
        assert_params_close(run, f"after load, step {step}")


def test_load_state_dict_with_host_work_in_flight() -> None:
    run_ranks(2, _load_in_flight)


def _worker_error(rank: int, world_size: int, max_grad_norm: float | None) -> None:
    run = InBackwardLockStep(
        Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True, max_grad_norm=max_grad_norm
    )
    run.step([torch.randn(BATCH, 12)])
    run.step([torch.randn(BATCH, 12)])  # (the buckets are rebuilt at its forward)
    run.ours.synchronize()
    stepped = run.ours.offload_stats()["buckets"]
    before = [p.detach().clone() for p in run.ours.parameters()]
    good_beta = run.ours.optimizer.param_groups[0]["betas"]
    run.ours.optimizer.param_groups[0]["betas"] = (1.5, 0.999)  # the host kernel rejects it
    accumulate(run.ours, [torch.randn(BATCH, 12)])  # backward itself returns
    with pytest.raises(ValueError, match="beta1 must be in"):
        run.ours(torch.randn(BATCH, 12))  # the next call raises the worker's error
    # The first step failed; with clipping the buckets held for the norm are dropped with it.
    after = list(run.ours.parameters())
    if max_grad_norm is not None:
        landed = [not torch.equal(a, b) for a, b in zip(after, before, strict=True)]
        assert not any(landed), f"a dropped step landed: {landed}"
    run.ours.optimizer.param_groups[0]["betas"] = good_beta
    accumulate(run.ours, [torch.randn(BATCH, 12)])  # the pipeline works again
    run.ours.synchronize()
    stats = run.ours.offload_stats()
    assert stats["iterations"] == 3, stats
    if max_grad_norm is not None:  # this iteration's buckets, not also the dropped ones
        assert stats["buckets"] == stepped + len(run.ours.reducer.bucket_indices()), stats


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_worker_error_surfaces_at_the_next_call(max_grad_norm: float | None) -> None:
    run_ranks(2, _worker_error, max_grad_norm)


_EXIT_SCRIPT = textwrap.dedent(
    """
    import functools, os, sys, torch, torch.distributed as dist
    import leanddp
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    ddp = leanddp.DistributedDataParallel(
        model, optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
        offload_to_cpu=True, bucket_cap_mb=1, offload_threads=1)
    ddp(torch.randn(64, 512)).sum().backward()
    stats = ddp.offload_stats()
    print("in flight:", stats["iterations"] == 0, flush=True)
    {ending}
    """
)


@pytest.mark.parametrize("ending", ["sys.exit(0)", "del ddp; dist.destroy_process_group()"])
def test_exit_with_host_work_in_flight(ending: str) -> None:
    """The process exits (or the wrapper is deleted) right after backward, with host steps
    queued: it neither hangs nor crashes."""
    from dist_harness import _free_port

    script = _EXIT_SCRIPT.format(port=_free_port(), ending=ending)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "in flight:" in done.stdout


def _delete_in_flight(rank: int, world_size: int) -> None:
    factory = OPTIMIZERS["adamw"]
    for _ in range(3):
        ddp = leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False), process_group=dist.new_group(),
            optimizer_in_backward=factory, offload_to_cpu=True, bucket_cap_mb=1e-6,
        )  # fmt: skip
        accumulate(ddp, [torch.randn(BATCH, 12)])
        del ddp  # host steps may be queued or running


def test_delete_wrapper_with_host_work_in_flight() -> None:
    run_ranks(2, _delete_in_flight)


# ------------------------------------------------------------------------------------------
# reading the parameters right after optimizer.step()


class Wide(nn.Module):
    """Enough weights that the host steps are still running when backward returns."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 256))
        self.head = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layers(x)))


def _read_after_step(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(
        Wide(), OPTIMIZERS["adamw-groups"], offload=True, max_grad_norm=0.05, offload_threads=1
    )
    emas = [[p.detach().clone() for p in ddp.module.parameters()] for ddp in (run.ref, run.ours)]
    for step in range(STEPS):
        batches = [torch.randn(BATCH, 12) for _ in range(2)]  # one under no_sync
        accumulate(run.ref, batches)
        torch.nn.utils.clip_grad_norm_(run.ref.module.parameters(), 0.05)
        run.ref_opt.step()
        accumulate(run.ours, batches)
        run.ours.optimizer.step()  # ours: makes the host steps' updates visible
        # The loop's own reads, right after step(): a copy of the parameters and an EMA.
        copies = []
        for ddp, ema in zip((run.ref, run.ours), emas, strict=True):
            with torch.no_grad():
                params = list(ddp.module.parameters())
                copies.append([p.detach().clone() for p in params])
                torch._foreach_lerp_(ema, params, 0.1)
        run.ref_opt.zero_grad()
        run.ours.optimizer.zero_grad()
        for s in run.scheds:
            s.step()
        for i, (a, b) in enumerate(zip(*copies, strict=True)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step} param {i}")
        for i, (a, b) in enumerate(zip(*emas, strict=True)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {step} EMA {i}")


def test_parameters_are_current_after_optimizer_step() -> None:
    """The loop torch's DDP users write (accumulation, clipping, an LR scheduler) reads the
    parameters right after ``optimizer.step()``: it sees this step's host update."""
    run_ranks(2, _read_after_step)


@LEANDDP_PATHS
@pytest.mark.parametrize("after_error", [False, True])
def test_released_on_its_own_worker_thread(after_error: bool) -> None:
    """The last reference to the host side dropped by its worker thread (its destructor runs
    there and cannot join itself): the process goes on and exits cleanly, where a joinable
    std::thread destroyed on its own thread would abort it. After an error the reference goes
    with a job the worker drops, which must not be destroyed under the worker's lock (the
    destructor's shutdown takes it: a deadlock)."""
    script = textwrap.dedent(
        f"""
        from leanddp import _C
        for _ in range(20):
            assert _C._testing.offload_released_on_worker(after_error={after_error})
        print("released")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "released" in done.stdout

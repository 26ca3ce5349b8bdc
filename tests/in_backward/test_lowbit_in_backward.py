"""optimizer_in_backward with torchao's 8-bit optimizers (``AdamW8bit``, ``Adam8bit``), stepped by
leanddp's 8-bit kernels bucket by bucket inside backward, against torch's DDP + torchao's own
optimizer in the same processes, on random data: on the CPU leanddp's kernel computes torchao's
compiled step exactly, so parameters, step counts, codes and scales are held equal bit for bit
after every step (accumulation, an LR scheduler, parameter groups with their own weight decay
and learning rate, Adam's L2 form, bfloat16 parameters, tiny buckets); ``optimizer.state`` is
torchao's format over leanddp's buffers, and memory_stats() counts it."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_models import accumulate
from dist_harness import run_ranks
from fault_models import Poison, nan_gradients
from in_backward_models import InBackwardLockStep, grouped, round_trip
from lowbit_models import (
    Quantizable,
    assert_torchao_state_equal,
    eager_numerics_switches,
    inductor_option,
    reference_numerics,
    resume_both_ways,
)

import leanddp

torchao_optim = pytest.importorskip("torchao.optim")

STEPS = 4
BATCH = 6

ADAMW8 = functools.partial(torchao_optim.AdamW8bit, lr=1e-2, weight_decay=0.1)

#: (name, model dtype, factory, accumulation, bucket_cap_mb)
VARIANTS = [
    ("adamw8bit", torch.float32, ADAMW8, 1, None),
    (
        "groups accum",
        torch.float32,
        grouped(torchao_optim.AdamW8bit, lr=1e-2, weight_decay=0.1),
        3,
        0.02,
    ),
    (
        "adam8bit",
        torch.float32,
        functools.partial(torchao_optim.Adam8bit, lr=1e-2, weight_decay=0.1),
        2,
        None,
    ),
    ("bf16", torch.bfloat16, ADAMW8, 2, 0.01),
]


def expected_state_bytes(state: dict) -> int:
    """Bytes leanddp holds for torchao's ``state`` of the same parameters: the codes and scales
    (one map pair in all, where torchao keeps one per moment), plain moments and step counts."""
    from torchao.optim.subclass_8bit import OptimState8bit

    total, maps = 0, 0
    for entry in state.values():
        total += entry["step"].nbytes
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry[key]
            if isinstance(value, OptimState8bit):
                total += value.codes.nbytes + value.scale.nbytes
                maps = 2 * value.qmap.nbytes
            else:
                total += value.nbytes
    return total + maps


def code_step_atol(lr: float, step: int) -> float:
    """How far a parameter may be from the reference's after steps 0..``step`` where a moment's
    code may round one step apart (at a tie, or after a last-bit difference): a code one step
    apart moves a moment by up to 1.4%, so each later update by up to lr * 1.4%; three of them
    per step."""
    return 3 * 0.014 * lr * (step + 1)


def _parity(rank: int, world_size: int, device: str = "cpu") -> None:
    """The variants against torch's DDP + torchao: bit for bit on the CPU; on a GPU (torchao's
    step compiled by inductor, with its eager-numerics switches: reference_numerics) within
    code_step_atol, bfloat16 one ulp."""
    from torchao.optim.subclass_8bit import OptimState8bit

    exact = device == "cpu"
    for name, dtype, factory, accum, cap in VARIANTS:
        torch.manual_seed(0)
        run = InBackwardLockStep(
            Quantizable(dtype).to(device),
            factory,
            fused_reference=False,
            reference_context=functools.partial(reference_numerics, device),
            bucket_cap_mb=cap,
        )
        lr = factory.keywords["lr"] if isinstance(factory, functools.partial) else 2e-2
        rtol = 2**-7 if dtype == torch.bfloat16 else 0.0
        ref_params = list(run.ref.module.parameters())
        our_params = list(run.ours.module.parameters())
        for step in range(STEPS):
            run.step([torch.randn(BATCH, Quantizable.IN, device=device) for _ in range(accum)])
            what = f"{name} step {step}"
            for pname, a, b in run.pairs():
                if exact:
                    assert torch.equal(a, b), f"{what} {pname}: max diff {(a - b).abs().max()}"
                else:
                    atol = code_step_atol(lr, step)
                    torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=f"{what} {pname}")
            for p_ref, p_ours in zip(ref_params, our_params, strict=True):
                ref_state = run.ref_opt.state[p_ref]
                ours_state = run.ours.optimizer.state[p_ours]
                shape = tuple(p_ours.shape)
                assert_torchao_state_equal(ours_state, ref_state, f"{what} {shape}", exact)
        quantized = [
            isinstance(run.ours.optimizer.state[p]["exp_avg"], OptimState8bit) for p in our_params
        ]
        assert quantized == [p.numel() >= 4096 for p in our_params], f"{name}: {quantized}"
        link = run.ours._in_backward
        assert link.fallback.calls == 0 and all(link.fused), f"{name}: the fallback stepped"
        stats = run.ours.memory_stats()
        expected = expected_state_bytes(run.ref_opt.state)
        assert stats["optimizer_state_bytes"] == expected, (name, stats, expected)


def test_parity_with_torch_ddp_and_torchao() -> None:
    run_ranks(2, _parity)


def _offload(rank: int, world_size: int) -> None:
    """offload_to_cpu with the 8-bit state on the host, stepped by the CPU kernel: float32
    parameters against torch's DDP + torchao bit for bit (accumulation, groups, an LR
    scheduler); with max_grad_norm the clipping coefficients may differ in the last bit, and a
    code may then round one step apart: within 1e-5 relative and code_step_atol, and most codes
    equal. The state, float32 on the host, in torchao's format."""
    variants = [
        ("offload", ADAMW8, 2, None),
        ("offload groups", VARIANTS[1][2], 1, None),
        ("offload clipped", ADAMW8, 2, 0.05),
    ]
    for name, factory, accum, max_norm in variants:
        torch.manual_seed(0)
        run = InBackwardLockStep(
            Quantizable(), factory, fused_reference=False, offload=True, max_grad_norm=max_norm
        )
        exact = max_norm is None
        for step in range(STEPS):
            run.step([torch.randn(BATCH, Quantizable.IN) for _ in range(accum)])
            what = f"{name} step {step}"
            for pname, a, b in run.pairs():
                tol = (
                    dict(rtol=0.0, atol=0.0)
                    if exact  # (the clipped variant's factory is ADAMW8, a partial)
                    else dict(rtol=1e-5, atol=code_step_atol(factory.keywords["lr"], step))
                )
                torch.testing.assert_close(b, a, **tol, msg=f"{what} {pname}")
            pairs = zip(run.ref.module.parameters(), run.ours.module.parameters(), strict=True)
            for p_ref, p_ours in pairs:
                assert_torchao_state_equal(
                    run.ours.optimizer.state[p_ours],
                    run.ref_opt.state[p_ref],
                    f"{what} {tuple(p_ours.shape)}",
                    exact,
                )
        assert run.ours.offload_stats()["buckets"] > 0, name


def test_offload_parity_with_torch_ddp_and_torchao() -> None:
    run_ranks(2, _offload)


def _offload_bf16(rank: int, world_size: int) -> None:
    """offload_to_cpu with bfloat16 parameters: the host steps float32 masters with 8-bit state;
    against torch's DDP on the same bfloat16 model with torchao's AdamW8bit stepping float32
    copies of the weights (their gradients the bfloat16 ones, widened) that are then rounded
    into the model: weights, masters and state equal bit for bit."""
    torch.manual_seed(0)
    model = Quantizable(torch.bfloat16)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    masters = [p.detach().float() for p in ref.module.parameters()]
    ref_opt = ADAMW8(masters)
    ours = leanddp.DistributedDataParallel(
        copy.deepcopy(model), optimizer_in_backward=ADAMW8, offload_to_cpu=True
    )
    for step in range(STEPS):
        batches = [torch.randn(BATCH, Quantizable.IN) for _ in range(2)]
        for ddp in (ref, ours):
            accumulate(ddp, batches)
        for master, p in zip(masters, ref.module.parameters(), strict=True):
            master.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for master, p in zip(masters, ref.module.parameters(), strict=True):
                p.copy_(master)
        ours.synchronize()
        for (pname, a), b, master in zip(
            ref.module.named_parameters(), ours.module.parameters(), masters, strict=True
        ):
            what = f"bf16 offload step {step} {pname}"
            assert torch.equal(a, b), what
            state = ours.optimizer.state[b]
            assert torch.equal(state["master_weight"], master), what
            actual = {k: v for k, v in state.items() if k != "master_weight"}
            assert_torchao_state_equal(actual, ref_opt.state[master], what)


def test_offload_bf16_steps_float32_masters() -> None:
    run_ranks(2, _offload_bf16)


def test_device_reference_steps_with_eager_numerics() -> None:
    """The device cases' reference: torchao's step compiled with inductor's eager numerics on
    (no fused multiply-adds, IEEE division), by the names this torch gives them; on the CPU,
    unchanged."""
    names = eager_numerics_switches()
    assert len(names) == 2, names

    def values() -> list[object]:
        return [inductor_option(n) for n in names]

    before = values()
    with reference_numerics("cuda"):
        assert values() == [True, True], names
    assert values() == before
    with reference_numerics("cpu"):
        assert values() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_parity_with_torch_ddp_and_torchao() -> None:
    """The same on a GPU (NCCL, world size 1): the 8-bit steps on the side stream."""
    run_ranks(1, _parity, "cuda", backend="nccl")


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_checkpoints_both_ways_resume_exactly(offload: bool) -> None:
    """torchao's optimizer on torch's DDP loads leanddp's checkpoint and the other way round;
    resuming equals never stopping, bit for bit."""
    run_ranks(2, resume_both_ways, ADAMW8, offload)


def _dcp(rank: int, world_size: int, path: Path) -> None:
    """``optimizer.state_dict()`` (torchao's 8-bit tensors over leanddp's buffers) through
    torch.distributed.checkpoint: saved at step 2 and loaded, as dcp loads, in place into a
    wrapper's own state dict (one that has state: a step taken), then load_state_dict(); from
    there it equals the run that never stopped, bit for bit (weights and state)."""
    torch.manual_seed(0)
    model = Quantizable()
    torch.manual_seed(1 + rank)
    data = [torch.randn(BATCH, Quantizable.IN) for _ in range(5)]

    def wrap() -> leanddp.DistributedDataParallel:
        return leanddp.DistributedDataParallel(
            copy.deepcopy(model), optimizer_in_backward=ADAMW8, process_group=dist.new_group()
        )

    never = wrap()
    for x in data[:2]:
        never(x).square().mean().backward()
    dcp.save(
        {"optim": never.optimizer.state_dict(), "model": never.module.state_dict()},
        checkpoint_id=path,
    )
    resumed = wrap()
    resumed(data[4]).square().mean().backward()  # (its own state, which the load replaces)
    template = {"optim": resumed.optimizer.state_dict(), "model": resumed.module.state_dict()}
    dcp.load(template, checkpoint_id=path)
    resumed.module.load_state_dict(template["model"])
    resumed.optimizer.load_state_dict(template["optim"])
    for step, x in enumerate(data[2:4], start=2):
        for ddp in (never, resumed):
            ddp(x).square().mean().backward()
        pairs = zip(never.module.parameters(), resumed.module.parameters(), strict=True)
        for a, b in pairs:
            assert torch.equal(a, b), f"step {step} {tuple(a.shape)}"
            state = resumed.optimizer.state[b]
            assert_torchao_state_equal(state, never.optimizer.state[a], f"step {step}")


def test_dcp_resumes_exactly(tmp_path: Path) -> None:
    run_ranks(2, _dcp, tmp_path)


def _float_checkpoint(rank: int, world_size: int, sharded: bool) -> None:
    """torch's AdamW checkpoint (float32 moments) loaded into the 8-bit optimizer (its state
    whole, or each rank's shard of it): the moments of 8-bit parameters are quantized as
    torchao's quantizer does, the others kept, and the training goes on from there."""
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.manual_seed(0)
    model = Quantizable()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(BATCH, Quantizable.IN)).square().mean().backward()
        plain.step()
    saved = round_trip(plain.state_dict())
    ours = leanddp.DistributedDataParallel(
        model, optimizer_in_backward=ADAMW8, shard_optimizer_state=sharded
    )
    ours.optimizer.load_state_dict(saved)
    states = ours.optimizer.state_dict()["state"]  # (gathered from the shards, sharded)
    for (i, entry), p in zip(saved["state"].items(), model.parameters(), strict=True):
        state = states[i]
        assert float(state["step"]) == float(entry["step"])
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if p.numel() < 4096:
                assert torch.equal(state[key], entry[key]), key
                continue
            expected = OptimState8bit.zeros(p.shape, signed, 256, dtype=p.dtype)
            expected.copy_(entry[key])
            assert isinstance(state[key], OptimState8bit), key
            assert torch.equal(state[key].codes, expected.codes), key
            assert torch.equal(state[key].scale, expected.scale), key
    before = [p.detach().clone() for p in ours.module.parameters()]
    ours(torch.randn(BATCH, Quantizable.IN)).square().mean().backward()
    states = ours.optimizer.state_dict()["state"]
    for (i, p), old in zip(enumerate(ours.module.parameters()), before, strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, old)
        assert float(states[i]["step"]) == 3.0


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_float_checkpoint_is_quantized_on_load(sharded: bool) -> None:
    run_ranks(2, _float_checkpoint, sharded)


def _refused(rank: int, world_size: int) -> None:
    """What the 8-bit kernels do not step is refused before any state changes where no fallback
    exists (shard_optimizer_state with a parameter that is not contiguous, offload_to_cpu with an
    option the kernels do not implement, a GradScaler), and stepped by torchao's own step per
    bucket on the device."""
    model = Quantizable()
    with pytest.raises(ValueError, match="shard_optimizer_state needs contiguous parameters"):
        leanddp.DistributedDataParallel(
            _WithTransposed(), optimizer_in_backward=ADAMW8, shard_optimizer_state=True
        )
    cases = [
        (
            dict(offload_to_cpu=True),
            functools.partial(torchao_optim.AdamW8bit, amsgrad=True),
            "AdamW8bit with amsgrad set",
        ),
        (
            dict(grad_scaler=torch.amp.GradScaler("cpu")),
            ADAMW8,
            "the 8-bit kernels .AdamW8bit. do not unscale",
        ),
    ]
    for kwargs, factory, message in cases:
        with pytest.raises(ValueError, match=message):
            leanddp.DistributedDataParallel(model, optimizer_in_backward=factory, **kwargs)
    # bf16_stochastic_round rounds only bfloat16 parameters: without any, the kernels step
    options = [(dict(bf16_stochastic_round=True), True), (dict(block_size=8192), False)]
    for option, fused in options:
        factory = functools.partial(torchao_optim.AdamW8bit, lr=1e-2, weight_decay=0.1, **option)
        run = InBackwardLockStep(model, factory, with_scheduler=False, fused_reference=False)
        run.step([torch.randn(BATCH, Quantizable.IN)])
        assert (run.ours._in_backward.kind is not None) == fused, option
        assert (run.ours._in_backward.fallback.calls == 0) == fused, option
        for pname, a, b in run.pairs():
            assert torch.equal(a, b), f"{option} {pname}"
    stochastic = functools.partial(torchao_optim.AdamW8bit, bf16_stochastic_round=True)
    bf16 = leanddp.DistributedDataParallel(
        Quantizable(torch.bfloat16), optimizer_in_backward=stochastic
    )
    assert bf16._in_backward.kind is None


class _WithTransposed(Quantizable):
    """Quantizable and a transposed (not contiguous) 256 x 16 weight, which the 8-bit kernels
    leave to the fallback, in a bucket with parameters they step."""

    def __init__(self) -> None:
        super().__init__()
        self.side = torch.nn.Parameter(torch.randn(16, 256).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        return self.down(h) + h @ self.side


def _mixed(rank: int, world_size: int) -> None:
    """A bucket of parameters the 8-bit kernels step and one the fallback steps (torchao's own
    step, its state its own): equal to torch's DDP + torchao bit for bit, and the kernels'
    buffers hold the stepped parameters' state only (codes, scales, plain moments)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.manual_seed(0)
    run = InBackwardLockStep(_WithTransposed(), ADAMW8, with_scheduler=False, fused_reference=False)
    for _ in range(2):
        run.step([torch.randn(BATCH, Quantizable.IN)])
        for pname, a, b in run.pairs():
            assert torch.equal(a, b), pname
    link = run.ours._in_backward
    # (side, a parameter of the module itself, comes first)
    assert link.fused == [False, True, True, True, True] and link.fallback.calls > 0
    assert len(run.ours.reducer.bucket_indices()) == 1
    held = 0
    for p, fused in zip(run.ours.module.parameters(), link.fused, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            v = run.ours.optimizer.state[p][key]
            if fused:
                held += (
                    v.codes.nbytes + v.scale.nbytes if isinstance(v, OptimState8bit) else v.nbytes
                )
    assert link.core.memory_stats().state_bytes == held


def test_kernels_and_fallback_share_a_bucket() -> None:
    run_ranks(2, _mixed)


def test_options_the_kernels_lack_are_refused_or_fall_back() -> None:
    run_ranks(2, _refused)


class _PoisonedUp(Quantizable):
    """Quantizable whose ``up`` layer's gradients are NaN while ``Poison.mode`` is "nan"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(Poison.apply(torch.tanh(self.up(x))))


def _nan_check(rank: int, world_size: int) -> None:
    """check_for_nan_in_grad with the 8-bit kernels: a NaN in ``up``'s reduced gradients raises
    on every rank; ``down`` (reduced first, in its own bucket) was stepped, ``up``'s kernel
    skipped it through found_inf: its weights, codes, scales and step counts are as before, and
    training goes on."""
    torch.manual_seed(0)
    ddp = leanddp.DistributedDataParallel(
        _PoisonedUp(), optimizer_in_backward=ADAMW8, bucket_cap_mb=0.015, check_for_nan_in_grad=True
    )
    x = torch.randn(BATCH, Quantizable.IN)

    def snapshot() -> dict[str, list[torch.Tensor]]:
        ddp.synchronize()
        out = {}
        for name, p in ddp.module.named_parameters():
            state = ddp.optimizer.state[p]
            tensors = [p, state["step"]]
            for key in ("exp_avg", "exp_avg_sq"):
                v = state[key]
                tensors += [v.codes, v.scale] if hasattr(v, "codes") else [v]
            out[name] = [t.detach().clone() for t in tensors]
        return out

    for _ in range(2):
        ddp(x).square().mean().backward()
    before = snapshot()
    with nan_gradients(), pytest.raises(RuntimeError, match="check_for_nan_in_grad"):
        ddp(x).square().mean().backward()
    after = snapshot()
    for name in before:
        same = all(torch.equal(a, b) for a, b in zip(before[name], after[name], strict=True))
        diffs = [
            i
            for i, (a, b) in enumerate(zip(before[name], after[name], strict=True))
            if not torch.equal(a, b)
        ]
        assert same == name.startswith("up."), (
            f"{name}: changed={not same} {diffs} {before[name][1]} {after[name][1]}"
        )
        steps = float(after[name][1])
        assert steps == (2.0 if name.startswith("up.") else 3.0), f"{name}: step {steps}"
    ddp(x).square().mean().backward()
    for name, values in snapshot().items():
        assert torch.isfinite(values[0]).all(), name
        assert float(values[1]) == (3.0 if name.startswith("up.") else 4.0), name


def test_nan_check_skips_the_flagged_buckets() -> None:
    run_ranks(2, _nan_check)


class _WithUnused(Quantizable):
    """Quantizable and a 64 x 64 weight (8-bit state) that the forward never uses."""

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)
        self.unused = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)


def _master_without_state(rank: int, world_size: int) -> None:
    """offload_to_cpu with bfloat16 parameters keeps a float32 master for a parameter that has
    no 8-bit state yet (never used, or its state reset): optimizer.state holds the master
    alone, and training and state_dict() go on."""
    torch.manual_seed(0)
    ddp = leanddp.DistributedDataParallel(
        _WithUnused(),
        optimizer_in_backward=ADAMW8,
        offload_to_cpu=True,
        find_unused_parameters=True,
    )
    x = torch.randn(BATCH, Quantizable.IN)
    for _ in range(2):
        ddp(x).square().mean().backward()
    unused = ddp.module.unused.weight
    assert list(ddp.optimizer.state[unused]) == ["master_weight"]
    up = ddp.module.up.weight
    ddp.optimizer.state[up] = {}  # start over: the moments reset, the master stays
    ddp(x).square().mean().backward()
    ddp.synchronize()
    assert float(ddp.optimizer.state[up]["step"]) == 1.0
    saved = ddp.optimizer.state_dict()
    assert len(saved["state"]) == 5


def test_offload_master_without_state() -> None:
    run_ranks(2, _master_without_state)

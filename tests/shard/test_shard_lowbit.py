"""shard_optimizer_state with torchao's 8-bit optimizers (``AdamW8bit``), stepped by leanddp's 8-bit
kernels on each rank's shard, against torch's DDP + torchao's own optimizer in the same
processes, on random data of each rank's own: the shard cuts fall on block boundaries inside
every quantized parameter (cut parameters are checked to happen), so each rank steps whole
blocks, torchao's own. On the CPU at 2 ranks parameters, step counts, codes and scales (gathered
by ``state_dict()``) are equal bit for bit (bfloat16 parameters too); at 3 ranks (gloo's sums
of three may associate differently in other bucket layouts) and with global-norm clipping,
within a GPU's tolerance.
Each rank holds about 1/N of the state. Checkpoints: the gathered ``state_dict()`` is torchao's
and interchanges with it both ways, and resumes exactly; ``torch.distributed.checkpoint`` saves
on 2 ranks and loads on 3, on the device and with offload_to_cpu and bfloat16 masters."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from in_backward_models import InBackwardLockStep, grouped
from lowbit_models import (
    Quantizable,
    assert_torchao_state_equal,
    reference_numerics,
    resume_both_ways,
)

import leanddp

pytestmark = pytest.mark.leanddp_paths

torchao_optim = pytest.importorskip("torchao.optim")

STEPS = 4
BATCH = 6
SHARD = dict(shard_optimizer_state=True)

LR = 1e-2


def _tolerance(step: int) -> float:
    """How far a parameter may be from torch's after ``step + 1`` steps where the gradients may
    differ in the last bit: a moment rounded to the neighbouring code moves the next update by up
    to lr * 1.4% (a GPU's tolerance, test_lowbit_in_backward's)."""
    return 3 * 0.014 * LR * (step + 1)


ADAMW8 = functools.partial(torchao_optim.AdamW8bit, lr=LR, weight_decay=0.1)

#: (name, model dtype, factory, accumulation, bucket_cap_mb, offload, max_grad_norm)
VARIANTS = [
    ("adamw8bit", torch.float32, ADAMW8, 1, None, False, None),
    (
        "groups accum tiny buckets",
        torch.float32,
        grouped(torchao_optim.AdamW8bit, lr=LR, weight_decay=0.1),
        3,
        0.02,
        False,
        None,
    ),
    ("bf16", torch.bfloat16, ADAMW8, 2, 0.01, False, None),
    ("offload", torch.float32, ADAMW8, 2, None, True, None),
    ("clipped", torch.float32, ADAMW8, 1, None, False, 0.05),
]


def _unsharded_state_bytes(model: torch.nn.Module, offload: bool) -> int:
    """Bytes of the 8-bit state one rank holds unsharded: codes and a float32 scale per 256
    elements for each moment of the quantized parameters, plain moments for the others."""
    total = 0
    for p in model.parameters():
        if p.numel() >= 4096:
            total += 2 * (p.numel() + 4 * (p.numel() // 256))
        else:
            total += 2 * p.numel() * (4 if offload else p.element_size())
    return total


def _cut(ddp: leanddp.DistributedDataParallel) -> int:
    """How many parameters a shard boundary cuts (pieces on more than one rank)."""
    placement = ddp._optimizer_core.shard_placement()
    return sum(1 for pieces in placement if len({rank for rank, _, _ in pieces}) > 1)


def _parity(rank: int, world_size: int) -> None:
    for name, dtype, factory, accum, cap, offload, clip in VARIANTS:
        if dtype == torch.bfloat16 and world_size > 2:
            # (three ranks' bfloat16 gradients summed in another order differ by an ulp, which
            # flips Adam's first step for a gradient near zero: bit for bit at 2 ranks only)
            continue
        torch.manual_seed(0)  # the same model on every rank, each rank's own data
        model = Quantizable(dtype)
        torch.manual_seed(1 + rank)
        run = InBackwardLockStep(
            model,
            factory,
            fused_reference=False,
            offload=offload,
            max_grad_norm=clip,
            bucket_cap_mb=cap,
            ours_kwargs=dict(SHARD, **({} if offload else {"max_grad_norm": clip})),
        )
        # (clipped, the sharded and the whole norm may differ in the last bit)
        exact = clip is None and world_size == 2
        for step in range(STEPS):
            run.step([torch.randn(BATCH, Quantizable.IN) for _ in range(accum)])
            what = f"world={world_size} {name} step {step}"
            atol = 0.0 if exact else _tolerance(step)
            for pname, a, b in run.pairs():
                torch.testing.assert_close(b, a, rtol=0.0, atol=atol, msg=f"{what} {pname}")
            assert len(run.ours.optimizer.state) == 0, f"{what}: optimizer.state holds state"
            ours = run.ours.optimizer.state_dict()  # gathered from every rank's shard
            ref = run.ref_opt.state_dict()
            assert ours["state"].keys() == ref["state"].keys(), what
            for index, entry in ref["state"].items():
                assert_torchao_state_equal(ours["state"][index], entry, f"{what} {index}", exact)
        if clip is not None:
            norm = run.ours.offload_stats()["grad_norm"]
            assert norm == pytest.approx(run.ref_norm, rel=1e-5), f"{name}: norm {norm}"
            assert run.ref_norm > clip, f"{name}: the case never clipped"
        link = run.ours._in_backward
        assert link.fallback.calls == 0 and all(link.fused), f"{name}: the fallback stepped"
        assert _cut(run.ours) > 0, f"{name}: no parameter cut by a shard boundary"
        state = run.ours.memory_stats()["optimizer_state_bytes"]
        whole = _unsharded_state_bytes(run.ours.module, offload)
        assert state <= whole * (1 / world_size + 0.1), f"{name}: {state} of {whole} bytes"


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_torch_ddp_and_torchao(world_size: int) -> None:
    run_ranks(world_size, _parity)


class _WithUnused(Quantizable):
    """Quantizable and a 64 x 64 layer (an 8-bit weight, a plain bias) its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.never = torch.nn.Linear(64, 64)


def _unused(rank: int, world_size: int) -> None:
    """Parameters without gradients (find_unused_parameters; a static graph, whose buckets are
    rebuilt after the first iteration, moving the shards' state): never stepped, as torchao skips
    them, the others bit for bit."""
    for kwargs in (dict(find_unused_parameters=True), dict(static_graph=True)):
        torch.manual_seed(0)
        model = _WithUnused()
        torch.manual_seed(1 + rank)
        run = InBackwardLockStep(
            model, ADAMW8, fused_reference=False, bucket_cap_mb=0.02, ours_kwargs=SHARD, **kwargs
        )
        for step in range(STEPS):
            run.step([torch.randn(BATCH, Quantizable.IN)])
            for pname, a, b in run.pairs():
                assert torch.equal(a, b), f"{kwargs} step {step} {pname}"
        ours, ref = run.ours.optimizer.state_dict()["state"], run.ref_opt.state_dict()["state"]
        assert ours.keys() == ref.keys() and len(ref) == 4, f"{kwargs}: {sorted(ours)}"
        for index, entry in ref.items():
            assert_torchao_state_equal(ours[index], entry, f"{kwargs} {index}")
        assert torch.equal(run.ours.module.never.weight, model.never.weight), kwargs


def test_unused_parameters_are_not_stepped() -> None:
    run_ranks(2, _unused)


def _offload_bf16(rank: int, world_size: int) -> None:
    """bfloat16 parameters with offload_to_cpu: the host steps float32 masters with 8-bit state,
    shard by shard, exactly as the unsharded host steps them (which equal torchao stepping
    float32 copies: test_lowbit_in_backward); weights, masters and state equal bit for bit."""
    torch.manual_seed(0)
    model = Quantizable(torch.bfloat16)
    torch.manual_seed(1 + rank)
    kw = dict(optimizer_in_backward=ADAMW8, offload_to_cpu=True, process_group=dist.new_group())
    whole = leanddp.DistributedDataParallel(copy.deepcopy(model), **kw)
    kw["process_group"] = dist.new_group()
    sharded = leanddp.DistributedDataParallel(copy.deepcopy(model), **SHARD, **kw)
    for step in range(STEPS):
        x = torch.randn(BATCH, Quantizable.IN)
        for ddp in (whole, sharded):
            ddp(x).square().mean().backward()
            ddp.synchronize()
        for a, b in zip(whole.module.parameters(), sharded.module.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step} {tuple(a.shape)}"
        ours, ref = sharded.optimizer.state_dict(), whole.optimizer.state_dict()
        for index, entry in ref["state"].items():
            what = f"step {step} {index}"
            assert torch.equal(ours["state"][index]["master_weight"], entry["master_weight"]), what
            masterless = {k: v for k, v in entry.items() if k != "master_weight"}
            got = {k: v for k, v in ours["state"][index].items() if k != "master_weight"}
            assert_torchao_state_equal(got, masterless, what)


def test_offload_bf16_masters_equal_unsharded() -> None:
    run_ranks(2, _offload_bf16)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_checkpoints_both_ways_resume_exactly(offload: bool) -> None:
    """The gathered state_dict() loads into torchao's optimizer on torch's DDP, and torchao's
    into the shards; resuming equals never stopping, bit for bit."""
    run_ranks(2, resume_both_ways, ADAMW8, offload, SHARD)


#: (name, model dtype, leanddp's keyword arguments) of the checkpoints that stay sharded
DCP_CASES = [
    ("device", torch.float32, {}),
    ("offload bf16", torch.bfloat16, {"offload_to_cpu": True}),
]


def _dcp_save(rank: int, world_size: int, path: Path) -> None:
    for name, dtype, kwargs in DCP_CASES:
        torch.manual_seed(3)  # the same model on every rank, and in the loading run
        ddp = leanddp.DistributedDataParallel(
            Quantizable(dtype), optimizer_in_backward=ADAMW8, bucket_cap_mb=0.02, **SHARD, **kwargs
        )
        torch.manual_seed(4 + rank)
        for _ in range(3):
            ddp(torch.randn(BATCH, Quantizable.IN)).square().mean().backward()
        sharded = ddp.sharded_optimizer_state_dict()
        entry = sharded["state"]["up.weight"]
        assert entry["exp_avg"].dtype == torch.uint8 and entry["exp_avg.scale"].size() == (32,)
        if kwargs:
            assert entry["master_weight"].dtype == torch.float32, name
        dcp.save({"optimizer": sharded}, checkpoint_id=path / name / "dcp")
        gathered = ddp.optimizer.state_dict()  # the reference (a collective: every rank)
        if rank == 0:
            reference = {"optimizer": gathered, "model": ddp.module.state_dict()}
            torch.save(reference, path / name / "ref.pt")


def _dcp_load(rank: int, world_size: int, path: Path) -> None:
    for name, dtype, kwargs in DCP_CASES:
        saved = torch.load(path / name / "ref.pt", weights_only=False)
        torch.manual_seed(3)
        model = Quantizable(dtype)
        model.load_state_dict(saved["model"])
        ddp = leanddp.DistributedDataParallel(
            model, optimizer_in_backward=ADAMW8, **SHARD, **kwargs
        )  # default buckets this time
        template = {"optimizer": ddp.sharded_optimizer_state_dict()}
        dcp.load(template, checkpoint_id=path / name / "dcp")
        ddp.load_sharded_optimizer_state_dict(template["optimizer"])
        assert _cut(ddp) > 0, f"{name}: no parameter cut by a shard boundary on 3 ranks"
        gathered = ddp.optimizer.state_dict()
        assert gathered["param_groups"] == saved["optimizer"]["param_groups"], name
        for index, entry in saved["optimizer"]["state"].items():
            what = f"{name}: loaded {index}"
            assert gathered["state"][index].keys() == entry.keys(), what
            if "master_weight" in entry:
                assert torch.equal(
                    gathered["state"][index]["master_weight"], entry["master_weight"]
                )
            values = {k: v for k, v in gathered["state"][index].items() if k != "master_weight"}
            expected = {k: v for k, v in entry.items() if k != "master_weight"}
            assert_torchao_state_equal(values, expected, what)
    # and it trains on as torch's DDP + torchao loaded with that state (float32, on the device)
    saved = torch.load(path / "device" / "ref.pt", weights_only=False)
    model = Quantizable()
    model.load_state_dict(saved["model"])
    run = InBackwardLockStep(
        model, ADAMW8, with_scheduler=False, fused_reference=False, ours_kwargs=SHARD
    )
    template = {"optimizer": run.ours.sharded_optimizer_state_dict()}
    dcp.load(template, checkpoint_id=path / "device" / "dcp")
    run.ours.load_sharded_optimizer_state_dict(template["optimizer"])
    run.ref_opt.load_state_dict(saved["optimizer"])
    torch.manual_seed(5 + rank)
    for step in range(3):
        run.step([torch.randn(BATCH, Quantizable.IN)])
        for pname, a, b in run.pairs():
            torch.testing.assert_close(b, a, rtol=0.0, atol=_tolerance(step), msg=pname)


def _cuda(rank: int, world_size: int, device: str = "cuda") -> None:
    """On a GPU: the 8-bit steps of each rank's shard on the side stream (NCCL at world size 1:
    a reduce-scatter of one rank; two gloo ranks sharing the GPU: shards cut on block
    boundaries), against torch's DDP + torchao's step compiled with inductor's eager numerics
    (reference_numerics), within a GPU's tolerance: parameters within 3 * lr * 1.4% per step,
    at least 99.9% of the codes equal; the gathered state_dict() and a sharded state dict's
    pieces agree with it."""
    torch.manual_seed(0)
    model = Quantizable().to(device)
    torch.manual_seed(1 + rank)
    run = InBackwardLockStep(
        model,
        ADAMW8,
        fused_reference=False,
        reference_context=functools.partial(reference_numerics, device),
        bucket_cap_mb=0.02,
        ours_kwargs=SHARD,
    )
    for step in range(STEPS):
        run.step([torch.randn(BATCH, Quantizable.IN, device=device) for _ in range(2)])
        for pname, a, b in run.pairs():
            torch.testing.assert_close(b, a, rtol=0.0, atol=_tolerance(step), msg=pname)
    ours, ref = run.ours.optimizer.state_dict()["state"], run.ref_opt.state_dict()["state"]
    for index, entry in ref.items():
        assert_torchao_state_equal(ours[index], entry, f"cuda {index}", exact=False)
    sharded = run.ours.sharded_optimizer_state_dict()["state"]["up.weight"]
    for key in ("exp_avg", "exp_avg.scale"):
        for shard in sharded[key].local_shards():
            offset, numel = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            whole = ours[0]["exp_avg"]  # (up.weight is the first parameter)
            inner = whole.codes.reshape(-1) if key == "exp_avg" else whole.scale
            assert torch.equal(shard.tensor, inner[offset : offset + numel]), key
    if world_size > 1:
        assert _cut(run.ours) > 0, "no parameter cut by a shard boundary"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("world_size,backend", [(1, "nccl"), (2, "gloo")], ids=["nccl", "gloo"])
def test_cuda_sharded_parity(world_size: int, backend: str) -> None:
    run_ranks(world_size, _cuda, backend=backend)


def test_dcp_saved_on_two_ranks_loaded_on_three(tmp_path: Path) -> None:
    for name, _, _ in DCP_CASES:
        (tmp_path / name).mkdir()
    run_ranks(2, _dcp_save, tmp_path)
    run_ranks(3, _dcp_load, tmp_path)

"""``python -m leanddp.plan`` and the memory model behind it (leanddp._memory): the model's
per-parameter figures are docs/memory.md's table, a module's buckets are the Reducer's, the
host categories are what a running offload job reports, and "largest model" is a boundary. The
planner against what the bench measures, configuration by configuration:
tests/tools/test_bench.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import leanddp
from leanddp import _memory, plan

pytestmark = pytest.mark.leanddp_paths  # leanddp's memory model; CI's step 1 only (pyproject.toml)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "memory.md"
MODES = {m.name: m for m in _memory.MODES}
#: docs/memory.md's table rows, in order, and the configuration each describes
DOC_ROWS = [
    ("torch's DDP", "torch DDP"),
    ("leanddp (views)", "leanddp"),
    ("+ `optimizer_in_backward`", "leanddp + optimizer_in_backward"),
    ("+ `offload_to_cpu`", "leanddp + offload_to_cpu"),
    ("+ `shard_optimizer_state` (N ranks)", "leanddp in-backward sharded"),
    ("+ `shard_optimizer_state` + `offload_to_cpu`", "leanddp offload sharded"),
]


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 8)
    ).to(dtype)


def doc_table(header: str = "| configuration |") -> list[list[str]]:
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


#: docs/memory.md's 8-bit table rows, in order, and the configuration each describes
#: (and the world size: the sharded rows are at 8 ranks)
LOWBIT_ROWS = [
    ("torch's DDP + `AdamW8bit`", "torch DDP", 1),
    ("+ `optimizer_in_backward`", "leanddp + optimizer_in_backward", 1),
    ("+ `offload_to_cpu`", "leanddp + offload_to_cpu", 1),
    ("+ `shard_optimizer_state` (8 ranks)", "leanddp in-backward sharded", 8),
    ("+ `shard_optimizer_state` + `offload_to_cpu` (8 ranks)", "leanddp offload sharded", 8),
]


def test_docs_8bit_table_is_the_memory_model() -> None:
    """docs/memory.md's 8-bit table: bytes per parameter of torchao's AdamW8bit state for
    float32 and bfloat16 parameters (device) and on the host, as the memory model has them."""
    rows = doc_table("| configuration, 8-bit state |")
    assert [r[0] for r in rows] == [name for name, _, _ in LOWBIT_ROWS]

    def figure(cell: str) -> float:
        return float(re.search(r"([\d.]+) B", cell).group(1))

    for row, (_, name, world) in zip(rows, LOWBIT_ROWS, strict=True):
        fp32, bf16 = (_memory.per_parameter(MODES[name], e, "adamw8bit", world) for e in (4, 2))
        assert figure(row[1]) == round(fp32[0], 2), name
        assert figure(row[2]) == round(bf16[0], 2), name
        host = "—" if fp32[1] == 0 else f"{fp32[1]:.2f} B"
        assert row[3] == host or row[3].startswith(f"**{host}**"), (name, row[3])
        assert fp32[1] == bf16[1], name


def test_plan_counts_the_tensors_torchao_keeps_plain() -> None:
    """The planner's 8-bit state: 8-bit codes and scales for the tensors of at least 4096
    elements and a multiple of 256, plain moments for the others (mlp: its 16384- and
    32768-element weights are 8-bit, its biases and its 1024-element weight plain)."""
    shape = plan.shape_of(mlp())
    assert shape.plain8 == 256 + 128 + 128 * 8 + 8
    e = _memory.estimate(MODES["leanddp + optimizer_in_backward"], shape, optimizer="adamw8bit")
    quantized = 64 * 256 + 256 * 128
    assert e.bytes["optimizer_state"] == quantized * 2 * (1 + 4 / 256) + shape.plain8 * 8


def test_docs_memory_table_is_the_memory_model() -> None:
    """Every "on the device" and "on the host" figure of docs/memory.md's table (fp32 AdamW)
    is the model's bytes per parameter, at several world sizes for the sharded rows."""
    rows = doc_table()
    assert [r[0].split(" (default")[0] for r in rows] == [name for name, _ in DOC_ROWS]
    for row, (_, name) in zip(rows, DOC_ROWS, strict=True):
        device_cell, host_cell = row[-2], row[-1]
        for world in (2, 4, 8):
            device, host = _memory.per_parameter(MODES[name], 4, "adamw", world)
            if "8/N" in device_cell:
                assert device == 4 + 8 / world, (name, world)
            else:
                assert device == float(re.search(r"= ([\d.]+) B", device_cell).group(1)), name
            if host_cell == "—":
                assert host == 0, name
            elif "/N" in host_cell:
                assert host_cell.startswith("4p/N") and host == 16 / world, name
            else:
                assert host_cell.startswith("4p") and host == 16, name


#: docs/memory.md's accumulation table rows, in order, and the configuration each describes
ACCUMULATION_ROWS = [
    ("+ `optimizer_in_backward`", "leanddp + optimizer_in_backward"),
    ("+ `offload_to_cpu`", "leanddp + offload_to_cpu"),
    (
        "+ `offload_to_cpu`, `accumulate_on_host=False`",
        "leanddp + offload_to_cpu, accumulating on the device",
    ),
    ("+ `shard_optimizer_state` + `offload_to_cpu`", "leanddp offload sharded"),
]


def test_docs_accumulation_table_is_the_memory_model() -> None:
    """docs/memory.md's accumulation table (fp32 AdamW, accumulation 4): bytes per parameter
    on the device and the host, and the PCIe bytes per micro-batch, are the model's."""
    rows = doc_table("| configuration, accumulating |")
    assert [r[0] for r in rows] == [name for name, _ in ACCUMULATION_ROWS]
    p = 4

    def cell(text: str, world: int) -> float:  # "2p", "p/N + p", "4p/N + 2p" in bytes
        total = 0.0
        for term in re.findall(r"(\d*)p(/N)?", text.split(":")[0]):
            total += int(term[0] or 1) * p / (world if term[1] else 1)
        return total

    n = 1_000_000
    shape = _memory.Shape(n, p, 0)
    for row, (_, name) in zip(rows, ACCUMULATION_ROWS, strict=True):
        for world in (2, 4, 8):
            e = _memory.estimate(MODES[name], shape, world_size=world, accumulation=4)
            assert e.device / n == cell(row[1].split("=")[0].strip("* ≈"), world), (name, world)
            assert e.host / n == (0 if row[2] == "—" else cell(row[2], world)), (name, world)
            t = _memory.pcie_bytes(MODES[name], shape, world, accumulation=4)
            assert t.no_sync_to_host / n == (0 if row[3] == "—" else cell(row[3], world)), name
            if row[4] == "—":
                assert t.step_to_host == t.step_to_device == 0, name
                continue
            to_host, back = row[4].split(", ")
            assert t.step_to_host / n == cell(to_host, world), (name, world)
            assert t.step_to_device / n == cell(back, world), (name, world)


def test_count_and_dtype() -> None:
    shape = plan.shape_of(10_000_000, dtype=torch.bfloat16, bucket_cap_mb=1)
    assert shape.numel == 10_000_000 and shape.element_size == 2
    assert sum(shape.bucket_sizes()) == 20_000_000 and shape.largest_bucket == 2**20
    result = plan.plan(10_000_000, dtype=torch.bfloat16, world_size=4, bucket_cap_mb=1)
    by = {e.mode.name: e for e in result.estimates}
    assert by["torch DDP"].device == 10 * 10_000_000 + 4  # 5p, and one step counter
    # in flight: the window's buckets and one bucket of gradients outside them
    in_bw = by["leanddp + optimizer_in_backward"]
    assert in_bw.device == 6 * 10_000_000 + 3 * 2**20 and in_bw.transient == 3 * 2**20
    # with accumulation every bucket is kept
    accum = plan.plan(10_000_000, dtype=torch.bfloat16, accumulation=4, bucket_cap_mb=1)
    assert accum.estimates[2].bytes["buckets"] == 20_000_000


def test_module_buckets_are_the_reducers() -> None:
    run_ranks(1, _buckets_rank)


def _buckets_rank(rank: int, world: int) -> None:
    for in_backward, shard, offload in ((False, False, False), (True, True, True)):
        model = mlp()
        kwargs = {}
        if in_backward:
            kwargs = dict(
                optimizer_in_backward=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                shard_optimizer_state=shard,
                offload_to_cpu=offload,
            )
        ddp = leanddp.DistributedDataParallel(model, bucket_cap_mb=0.1, **kwargs)
        for _ in range(3):  # the rebuild comes after the first iteration
            ddp(torch.randn(4, 64)).square().sum().backward()
        ddp.synchronize()
        first = in_backward and shard and offload
        shape = plan.shape_of(model, bucket_cap_mb=0.1, first_layout=first)
        assert sorted(ddp.reducer.bucket_bytes()) == sorted(shape.bucket_sizes()), (first, shape)
        assert shape.numel == sum(p.numel() for p in model.parameters())
        if offload:  # the host categories are what the running job reports
            name = "leanddp offload sharded" if shard else "leanddp + offload_to_cpu"
            e = _memory.estimate(MODES[name], shape)
            s = ddp.memory_stats()
            assert s["host_master_bytes"] == e.bytes["host_masters"]
            assert s["host_buffer_bytes"] == e.bytes["host_staging"]
            assert s["optimizer_state_bytes"] - e.bytes["host_state"] <= 4 * shape.bucket_count
        del ddp


def test_meta_module_and_bf16_host_bytes() -> None:
    """A module on the meta device plans without memory; bf16 offload holds float32 state and
    masters and two bf16 staging buffers on the host: 16 bytes per parameter."""
    with torch.device("meta"):
        model = mlp(torch.bfloat16)
    result = plan.plan(model, configs=["leanddp + offload_to_cpu"])
    e = result.estimates[0]
    n = sum(p.numel() for p in model.parameters())
    assert e.bytes["parameters"] == 2 * n and e.host == 16 * n


def test_largest_model_is_the_boundary() -> None:
    result = plan.plan(
        50_000_000, world_size=8, gpu_memory_gb=1.0, host_memory_gb=4.0, bucket_cap_mb=4
    )
    for e in result.estimates:
        most = result.largest[e.mode.name]
        of = plan._estimator(e.mode, "adamw", 8, 1, False)
        fits = _memory.fits
        assert fits(of(result.shape.scaled(most)), 2**30, 4 * 2**30, False), e.mode.name
        assert not fits(of(result.shape.scaled(most + 1)), 2**30, 4 * 2**30, False), e.mode.name
        assert result.fits[e.mode.name] == (most >= 50_000_000)
    assert result.largest["torch DDP"] < result.largest["leanddp offload sharded"]
    # only host memory given, on a GPU: the modes that use none are not limited
    host_only = plan.plan(50_000_000, host_memory_gb=4.0)
    assert host_only.largest["leanddp"] is None and host_only.largest["leanddp + offload_to_cpu"]
    # on the CPU the device is the host: device and host bytes come out of the same memory
    cpu = plan.plan(50_000_000, host_memory_gb=4.0, device="cpu", bucket_cap_mb=4)
    for e in cpu.estimates:
        n = cpu.largest[e.mode.name]
        of = plan._estimator(e.mode, "adamw", 1, 1, False)
        assert fits(of(cpu.shape.scaled(n)), None, 4 * 2**30, True), e.mode.name
        assert not fits(of(cpu.shape.scaled(n + 1)), None, 4 * 2**30, True), e.mode.name


def test_bad_input_names_the_argument() -> None:
    for kwargs, message in (
        (dict(gpu_memory_gb=0), "gpu_memory_gb must be positive"),
        (dict(reserve_gb=-1), "reserve_gb must not be negative"),
        (dict(configs=["nope"]), "configs: unknown ['nope']"),
        (dict(optimizer="lamb"), "optimizer must be one of"),
        (dict(world_size=0), "world_size and accumulation must be at least 1"),
        (dict(device="tpu"), "device must be 'cuda' or 'cpu'"),
        (dict(device="cpu", gpu_memory_gb=8), "gpu_memory_gb: on the CPU"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            plan.plan(1000, **kwargs)
    with pytest.raises(TypeError, match="model must be an nn.Module or a parameter count"):
        plan.plan("gpt2")
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        plan.plan(nn.Linear(2, 2).requires_grad_(False))


def test_command_line() -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "leanddp.plan", "--model", "tiny", "--world-size", "4",
            "--gpu-memory-gb", "0.05", "--host-memory-gb", "1",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for m in _memory.MODES:
        assert f"| {m.name} |" in done.stdout
    assert "world size 4" in done.stdout and "**no**" in done.stdout and "yes" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "leanddp.plan", "--params", "1e6", "--accum", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--accum must be at least 1, got 0" in bad.stderr

"""The bench's accumulation lines: what gradient accumulation adds on the device for each
configuration, against accumulate_on_host's target, and offload_to_cpu's PCIe bytes per
micro-batch (the memory model's, leanddp._memory.pcie_bytes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leanddp import _memory

#: accumulate_on_host's target: with accumulation, at most this many more bytes per parameter on
#: the device than the same configuration without
TARGET = 0.5
#: offload_to_cpu accumulating on the device is offload_to_cpu itself without accumulation
#: (names of _worker.CONFIGS, repeated here so that the report needs no torch)
DEVICE_ACCUMULATION = "leanddp + offload_to_cpu, accumulating on the device"
OFFLOAD = "leanddp + offload_to_cpu"
ELEMENT_SIZE = {"fp32": 4, "bf16": 2}


def _without(run: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run of the same configuration (offload_to_cpu's, for its device-accumulating twin)
    without accumulation, at the same world size."""
    name = OFFLOAD if run["config"] == DEVICE_ACCUMULATION else run["config"]
    for other in runs:
        if (other["config"], other["accum"], other["world_size"]) == (name, 1, run["world_size"]):
            return other
    return None


def lines(
    report: dict[str, Any],
    runs: list[dict[str, Any]],
    per_param: Callable[[dict[str, Any], int], float],
) -> list[str]:
    """One line per run with accumulation that has a counterpart without; ``per_param``: a
    run's bytes per parameter on the device (_report.device_bytes_per_param)."""
    params = report["params"]
    size = ELEMENT_SIZE.get(report["args"]["dtype"], 4)
    out = []
    for r in runs:
        base = _without(r, runs) if r["accum"] > 1 else None
        if base is None:
            continue
        delta = per_param(r, params) - per_param(base, params)
        line = (
            f"- accumulation {r['accum']}, {r['config']}: {delta:+.2f} bytes per parameter on "
            f"the device against accumulation 1 (buckets {r['memory']['buckets'] / 2**20:.2f} "
            f"MiB against {base['memory']['buckets'] / 2**20:.2f}: a bucket more or less in "
            "flight is the reductions' timing)"
        )
        summed = r["memory"].get("host_accumulation", 0)
        if summed:
            mode, _ = _memory.mode_and_optimizer(r["config"])
            shape = _memory.Shape(params, size, 0)
            traffic = _memory.pcie_bytes(mode, shape, r["world_size"], r["accum"])
            line += (
                f"; accumulate_on_host, target ≤ +{TARGET}: "
                + ("met" if delta <= TARGET else "MISSED")
                + f"; host sums {summed / 2**20:.1f} MiB; PCIe per no_sync() micro-batch "
                f"{traffic.no_sync_to_host / 2**20:.1f} MiB to the host, per synchronized "
                f"micro-batch {traffic.step_to_host / 2**20:.1f} MiB to the host and "
                f"{traffic.step_to_device / 2**20:.1f} MiB back"
            )
        out.append(line + ".")
    return out

"""The machine and versions a benchmark's numbers were measured on (every benchmark's header)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

import leanddp


def environment(command: str) -> dict[str, Any]:
    """``command`` as run, the versions, this build of leanddp, the CPU and, if any, the GPU."""
    models = []
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    env = dict(
        command=command,
        python=platform.python_version(),
        torch=torch.__version__,
        leanddp=leanddp.__version__,
        build=leanddp.build_info(),
        cpu=models[0] if models else (platform.processor() or platform.machine()),
        cpus=os.cpu_count(),
        threads=torch.get_num_threads(),
    )
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env

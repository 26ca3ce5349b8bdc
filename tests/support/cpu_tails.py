"""Comparing the CPU and CUDA optimizer kernels: equal bit for bit except in each tensor's tail.

The CPU Adam(W) steps a tensor's last numel % (32 bytes / element size) elements with the
arithmetic of torch's scalar tail loop (csrc/ops/optim_math.h, kTail), as torch's fused CPU
kernel does; the CUDA kernel steps every element alike, as torch's CUDA kernel does. There the
two may differ by a rounding.
"""

from __future__ import annotations

import torch


def assert_equal_but_tails(cpu: torch.Tensor, cuda: torch.Tensor, param_dtype: torch.dtype) -> None:
    """``cpu`` equals ``cuda`` bit for bit before the tail of parameters of ``param_dtype``, and
    within one rounding of ``cpu``'s dtype in it."""
    width = 32 // torch.empty((), dtype=param_dtype).element_size()
    a, b = cpu.reshape(-1), cuda.cpu().reshape(-1)
    body = a.numel() - a.numel() % width
    assert torch.equal(a[:body], b[:body])
    rtol = 2 * torch.finfo(a.dtype).eps
    torch.testing.assert_close(a[body:], b[body:], rtol=rtol, atol=0)

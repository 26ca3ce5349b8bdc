"""leanddp: torch's DistributedDataParallel, in much less GPU memory.

``leanddp.DistributedDataParallel`` is a drop-in subclass of
``torch.nn.parallel.DistributedDataParallel`` whose reduction runs in leanddp's C++ Reducer, with
gradients stored once (``param.grad`` is a view into the flat communication bucket).
``leanddp.ops`` holds the custom ops it is built on: multi-tensor flatten/unflatten and fused
Adam/AdamW/SGD steps on flat memory, on CPU and CUDA.
"""

from torch.distributed import GradBucket  # what communication hooks receive (torch's own)

from . import ops
from ._config import DDPConfig
from ._extension import build_info
from ._version import __version__
from .ddp import DistributedDataParallel

__all__ = [
    "DDPConfig",
    "DistributedDataParallel",
    "GradBucket",
    "build_info",
    "ops",
    "__version__",
]

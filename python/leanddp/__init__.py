"""leanddp: torch's DistributedDataParallel, in much less GPU memory.

This release ships the foundation: the compiled extension and its custom ops (``leanddp.ops``):
multi-tensor flatten/unflatten and fused Adam/AdamW/SGD steps on flat memory, on CPU and CUDA.
"""

from . import ops
from ._extension import build_info

__version__ = "0.1.0"

__all__ = ["build_info", "ops", "__version__"]

"""optimizer_in_backward: the user's torch optimizer, stepped bucket by bucket inside backward.

The optimizer the user's factory returns becomes ``ddp.optimizer``. It stays an instance of
its class (its class is swapped for a subclass whose ``step()`` does nothing, because the real
steps happen inside backward), so its ``param_groups`` are the live hyper-parameters an LR
scheduler changes and its ``state_dict()`` has exactly torch's format.

* torch.optim.SGD, Adam and AdamW with options leanddp's fused kernels cover are stepped in
  C++ (``FusedOptimizer`` in csrc/fused_optimizer.h) on float32, bfloat16 and float16 buckets
  (float32 math; state in the parameters' dtype, as torch's fused optimizers keep it): their
  state lives in flat per-bucket buffers, and ``optimizer.state`` holds views of it. A tensor
  ``lr`` on the parameters' device is handed to the kernels as a tensor, never read by the host.
  A parameter in another dense layout (channels_last, a transposed matrix) is stepped there too:
  its gradient view and its state keep its strides, so the kernels go through memory in order.
* Every other case (another class, an option the kernels lack, a float64 parameter or one
  with gaps or overlaps, such as a strided slice) is stepped by a per-bucket instance of the
  user's class over that bucket's parameters, sharing ``optimizer.state``.
* ``grad_scaler`` (a ``torch.amp.GradScaler``): the kernels divide the gradients by its scale
  and skip, on the device, the buckets whose gradients hold inf/NaN (and every bucket stepped
  after one in that backward); ``scaler.step(ddp.optimizer)`` steps nothing and hands the
  iteration's ``found_inf`` to the scaler, so ``scaler.update()`` backs off or grows as usual.
* With ``offload_to_cpu`` every parameter is stepped on the host by the fused kernels
  (``HostOffload`` in csrc/host_offload.h): the state is in host memory, and bfloat16/float16
  parameters get float32 master weights there, exposed as ``state[p]["master_weight"]``.

One module per concern:

* ``_link``: :class:`InBackward`, which connects ``ddp.optimizer`` to the Reducer;
* ``_checks``: what the factory returned, and what the fused kernels and grad_scaler need;
* ``_facade``: the subclass ``ddp.optimizer`` becomes, and its load hooks;
* ``_fallback``: the per-bucket step of what the kernels do not cover;
* ``_clipping``: torch's clipping functions raise on in-backward parameters;
* ``_state``: ``optimizer.state`` as views of the fused state, and adopting what code wrote.
"""

# torch imports torch._dynamo when the first optimizer of a process is constructed. That import
# leaves its frames in cyclic garbage, and with them every calling frame: here the wrapper's
# __init__, which would keep the first DistributedDataParallel (its buckets, optimizer state and
# process group) alive after its last reference is dropped, until a full collection, often at
# interpreter exit. Importing it here, as the library loads, keeps the wrapper out of it.
import torch._dynamo  # noqa: F401

from ._checks import build_optimizer, check_fused, fused_kind
from ._clipping import guard_clipping
from ._link import InBackward

__all__ = [
    "InBackward",
    "build_optimizer",
    "check_fused",
    "fused_kind",
    "guard_clipping",
]

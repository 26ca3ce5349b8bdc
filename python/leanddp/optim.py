"""optimizer_in_backward: the user's torch optimizer, stepped bucket by bucket inside backward.

The optimizer the user's factory returns becomes ``ddp.optimizer``. It stays an instance of
its class (its class is swapped for a subclass whose ``step()`` does nothing, because the real
steps happen inside backward), so its ``param_groups`` are the live hyper-parameters an LR
scheduler changes and its ``state_dict()`` has exactly torch's format.

* torch.optim.SGD, Adam and AdamW with options leanddp's fused kernels cover are stepped in
  C++ (``FusedOptimizer`` in csrc/fused_optim.h) on float32, bfloat16 and float16 buckets
  (float32 math; state in the parameters' dtype, as torch's fused optimizers keep it): their
  state lives in flat per-bucket buffers, and ``optimizer.state`` holds views of it. A tensor
  ``lr`` on the parameters' device is handed to the kernels as a tensor, never read by the host.
  A parameter in another dense layout (channels_last, a transposed matrix) is stepped there too:
  its gradient view and its state keep its strides, so the kernels go through memory in order.
* Every other case (another class, an option the kernels lack, a float64 parameter or one
  with gaps or overlaps, such as a strided slice) is stepped by a per-bucket instance of the
  user's class over that bucket's parameters, sharing ``optimizer.state``
  (:class:`_FallbackStepper`).
* ``grad_scaler`` (a ``torch.amp.GradScaler``): the kernels divide the gradients by its scale
  and skip, on the device, the buckets whose gradients hold inf/NaN (and every bucket stepped
  after one in that backward); ``scaler.step(ddp.optimizer)`` steps nothing and hands the
  iteration's ``found_inf`` to the scaler, so ``scaler.update()`` backs off or grows as usual.
* With ``offload_to_cpu`` every parameter is stepped on the host by the fused kernels
  (``HostOffload`` in csrc/offload.h): the state is in host memory, and bfloat16/float16
  parameters get float32 master weights there, exposed as ``state[p]["master_weight"]``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

# torch imports torch._dynamo when the first optimizer of a process is constructed. That import
# leaves its frames in cyclic garbage, and with them every calling frame: here the wrapper's
# __init__, which would keep the first DistributedDataParallel (its buckets, optimizer state and
# process group) alive after its last reference is dropped, until a full collection, often at
# interpreter exit. Importing it here, as the library loads, keeps the wrapper out of it.
import torch._dynamo  # noqa: F401
from torch import Tensor, nn

from ._optim_state import StateView

_FUSED_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}


def _fail(message: str, cls: type[Exception] = ValueError) -> None:
    raise cls(f"leanddp.DistributedDataParallel: optimizer_in_backward: {message}")


def build_optimizer(
    factory: Callable[..., torch.optim.Optimizer],
    module: nn.Module,
    trainable: Sequence[tuple[str, nn.Parameter]],
) -> tuple[torch.optim.Optimizer, list[int]]:
    """Calls ``factory(module.parameters())`` and checks what it returns: a torch optimizer
    holding every trainable parameter exactly once and no other parameter that requires a
    gradient. Returns it and, per trainable parameter, the index of its param group."""
    optimizer = factory(module.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        _fail(
            f"the factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}",
            TypeError,
        )
    index = {id(p): i for i, (_, p) in enumerate(trainable)}
    names = {id(p): n for n, p in module.named_parameters()}
    group_of = [-1] * len(trainable)
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            i = index.get(id(p))
            if i is None:
                if p.requires_grad:
                    _fail(
                        f"the optimizer holds parameter {names.get(id(p), '(not in the module)')!r}"
                        ", which DistributedDataParallel does not train (it would never be "
                        "stepped); build the optimizer over the wrapped module's parameters"
                    )
                continue
            if group_of[i] >= 0:
                _fail(f"parameter {trainable[i][0]!r} is in more than one param group")
            group_of[i] = g
    missing = [trainable[i][0] for i, g in enumerate(group_of) if g < 0]
    if missing:
        _fail(
            f"the optimizer does not hold parameter {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: every parameter "
            "that requires a gradient must be optimized (freeze the others with "
            "requires_grad_(False) before wrapping)"
        )
    return optimizer, group_of


_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fused(
    optimizer: torch.optim.Optimizer,
    trainable: Sequence[tuple[str, nn.Parameter]],
    what: str,
    contiguous: bool,
) -> None:
    """``what`` (offload_to_cpu, shard_optimizer_state) steps every parameter with the fused
    kernels: raises a ValueError naming what they cannot step (before any state changes).
    ``contiguous``: the parameters must be contiguous (else dense in some layout)."""
    if not fused_kind(optimizer):
        _fail(
            f"{what} steps with leanddp's fused kernels, which cover torch.optim.SGD, Adam and "
            f"AdamW (without amsgrad or differentiable); got {type(optimizer).__name__}"
            + (" with amsgrad or differentiable set" if fused_kind(type(optimizer)) else "")
        )
    for name, p in trainable:
        if p.dtype not in _MASTER_DTYPES:
            _fail(
                f"{what} steps float32, bfloat16 and float16 parameters; parameter {name!r} is "
                f"{p.dtype}"
            )
        if not (p.is_contiguous() if contiguous else _is_dense(p)):
            _fail(
                f"{what} needs {'contiguous' if contiguous else 'dense'} parameters; parameter "
                f"{name!r} has strides {p.stride()} (make it contiguous before wrapping)"
            )


def _is_dense(t: Tensor) -> bool:
    """Whether ``t`` is non-overlapping and dense in some layout (c10's
    ``is_non_overlapping_and_dense``, which is what the C++ side's ``can_step`` asks): its
    elements, ordered by stride, fill exactly ``numel`` consecutive slots."""
    expected = 1
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz >= 2)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def fused_kind(optimizer: torch.optim.Optimizer | type) -> str:
    """ "sgd" or "adam" when leanddp's fused kernels can step this optimizer (or class), else
    ""."""
    if isinstance(optimizer, type):
        return _FUSED_KINDS.get(_base_class_of(optimizer), "")
    kind = _FUSED_KINDS.get(_base_class(optimizer), "")
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("amsgrad"):
            return ""
    return kind


def _lr(lr: Any, device: torch.device | None) -> float | Tensor:
    """The learning rate for the kernels: a one-element tensor on ``device`` (the kernels read
    it when they run, so the host never waits for it); anything else as a float (a CPU tensor
    read in host memory). ``device`` None: the host steps (offload_to_cpu), which read a tensor
    lr in host memory only; reading one from a GPU would synchronize at every forward."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or lr.dtype not in (torch.float32, torch.float64):
            _fail(f"a tensor lr must have one float32/float64 element, got {lr.dtype} {lr.shape}")
        if device is not None and lr.device == device:
            return lr.reshape(())
        if lr.device.type != "cpu":
            if device is None:
                _fail(
                    "with offload_to_cpu the host steps read the learning rate in host memory: "
                    f"a tensor lr must be on the CPU, got {lr.device}"
                )
            _fail(
                f"a tensor lr must be on the parameters' device ({device}) or the CPU, got "
                f"{lr.device}"
            )
    return float(lr)


def _hyper(group: dict[str, Any], cls: type, device: torch.device | None = None) -> dict[str, Any]:
    """A param group's hyper-parameters in the fused optimizer's terms (``device``: where a
    tensor lr may stay a tensor; None: read it as a float)."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    return dict(
        lr=_lr(group["lr"], device),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group.get("eps", 1e-8)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        nesterov=bool(group.get("nesterov", False)),
        maximize=bool(group.get("maximize", False)),
        decoupled=cls is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False)),
    )


class InBackward:
    """Connects ``ddp.optimizer`` to the Reducer: pushes hyper-parameters before each forward,
    exposes the fused state as ``optimizer.state`` and loads checkpoints into it."""

    def __init__(
        self,
        ddp: nn.Module,
        optimizer: torch.optim.Optimizer,
        group_of: list[int],
        params: list[nn.Parameter],
        offload: bool = False,
        offload_threads: int = 1,
        max_grad_norm: float | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        names: Sequence[str] | None = None,
        sharded: bool = False,
    ) -> None:
        self._ddp = weakref.ref(ddp)  # the Reducer holds the optimizer: no cycle through C++
        self.optimizer = optimizer
        self.cls = _base_class(optimizer)
        self.kind = fused_kind(optimizer)
        self.params = params
        self.group_of = group_of
        self.offload = (offload, offload_threads, max_grad_norm)
        layout_ok = Tensor.is_contiguous if offload else _is_dense
        self.fused = [
            bool(self.kind) and p.dtype in _MASTER_DTYPES and layout_ok(p) for p in params
        ]
        self.loading = False  # inside optimizer.load_state_dict(): the state is the loaded one
        self.device = params[0].device
        if grad_scaler is not None:
            _check_scaler(grad_scaler, self, names or [str(i) for i in range(len(params))])
        self.scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.found_inf: Tensor | None = None  # this iteration's (GradScaler)
        on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
        # GradScaler: Adam's step counts live on the device (a skipped step is taken back there).
        on_device = on_device or self.scaler is not None
        self.step_device = str(params[0].device) if on_device and not offload else "cpu"
        self.view = StateView(
            optimizer,
            self.kind,
            params,
            names or [str(i) for i in range(len(params))],
            self.fused,
            group_of,
            offload,
            sharded,
        )
        self.sharded = sharded
        self.fallback = _FallbackStepper(optimizer, self.cls, params, group_of)
        _make_facade(optimizer, self)
        guard_clipping(params)

    @property
    def reducer(self) -> Any:
        ddp = self._ddp()
        return None if ddp is None else ddp.reducer

    def attach(self, reducer: Any) -> None:
        """Hands the optimizer to a (new) Reducer; state already in ``optimizer.state`` moves
        into it."""
        reducer.set_optimizer(
            self.kind,
            self.params,
            self.group_of,
            self._hypers(),
            self.step_device,
            self.fallback,
            *self.offload,
        )
        self.view.generation = -1
        if self.optimizer.__dict__["state"]:
            self.load_state()

    def wait_for_steps(self) -> None:
        """Makes the last backward's steps visible to the caller (``ddp.synchronize()``): with
        offload_to_cpu the host waits for the host steps and raises an error one met; on a GPU
        the current stream is ordered after the side stream's steps."""
        reducer = self.reducer
        if reducer is not None:
            reducer.wait_for_steps(host_too=self.offload[0])

    def _hypers(self) -> list[dict[str, Any]]:
        device = None if self.offload[0] else self.device  # the host step takes numbers
        return [_hyper(g, self.cls, device) for g in self.optimizer.param_groups]

    def before_forward(self) -> None:
        """Makes the current hyper-parameters (and GradScaler's scale) the ones the next
        in-backward steps use, and adopts optimizer state code replaced since the last one."""
        self.loading = False  # a load_state_dict that raised changed nothing
        if self.kind:
            self.reducer.set_optimizer_groups(self._hypers())
        if self.scaler is not None:
            scaler = self.scaler
            if scaler._scale is None:  # what scaler.scale(loss) would do, a step earlier
                scaler._lazy_init_scale_growth_tracker(self.device)
            scale = scaler._scale
            if scale.device != self.device:
                _fail(f"grad_scaler's scale is on {scale.device}, the parameters on {self.device}")
            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
            self.reducer.set_grad_scaler(scale, self.found_inf)
        self.optimizer._opt_called = True  # LR schedulers: the optimizer does step
        if self.kind:
            self.view.adopt(self.reducer)
        self.sync_state()
        if self.kind:
            self.view.mark()

    def sync_state(self) -> None:
        """Points ``optimizer.state`` at the fused state (after it was created or moved)."""
        reducer = self.reducer
        if reducer is None or not self.kind or self.loading:
            return
        self.view.sync(reducer)

    def load_state(self) -> None:
        """Copies what ``optimizer.state`` holds for fused parameters into the fused state."""
        self.loading = False
        reducer = self.reducer
        if reducer is None or not self.kind:
            return
        reducer.set_optimizer_groups(self._hypers())  # the loaded groups (momentum on or off)
        self.view.load_all(reducer)

    def gathered_state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """shard_optimizer_state: every parameter's state in torch's format, gathered from
        every rank's shard (a collective: every rank calls it and gets the whole state)."""
        entries = self.reducer.gathered_optimizer_state()
        return {p: dict(e) for p, e in zip(self.params, entries, strict=True) if e}

    def state_bytes(self) -> int:
        """Bytes of optimizer state (fused buffers and fallback state alike; this rank's
        shard of it with shard_optimizer_state)."""
        if self.sharded:
            return self.reducer.memory_stats().optimizer_state_bytes
        self.sync_state()
        seen: dict[tuple[str, int], int] = {}
        for entry in self.optimizer.__dict__["state"].values():
            for key, value in entry.items():
                if key == "master_weight":  # counted as master weights, not state
                    continue
                if isinstance(value, Tensor) and value.numel() > 0:
                    storage = value.untyped_storage()
                    seen[(str(value.device), storage.data_ptr())] = storage.nbytes()
        return sum(seen.values())


def _check_scaler(scaler: Any, link: InBackward, names: Sequence[str]) -> None:
    """Raises a clear error where the in-backward steps cannot apply ``scaler``."""
    if not scaler.is_enabled():
        return
    if link.offload[0]:
        _fail(
            "grad_scaler is not supported with offload_to_cpu (the host steps would have to "
            "read the scale and found_inf from the device); use bfloat16, which needs no scaler"
        )
    if not link.kind:
        _fail(
            "grad_scaler needs an optimizer leanddp's fused kernels step (torch.optim.SGD, "
            f"Adam or AdamW without amsgrad or differentiable); got {link.cls.__name__}"
        )
    for i, fused in enumerate(link.fused):
        if not fused:
            p = link.params[i]
            _fail(
                f"grad_scaler: parameter {names[i]!r} ({p.dtype}, strides {p.stride()}) is not "
                "stepped by the fused kernels (float32/bfloat16/float16, contiguous), and a "
                "per-bucket Python step cannot skip an overflowing step without synchronizing"
            )


class _FallbackStepper:
    """Steps a bucket's parameters with a per-bucket instance of the user's optimizer class.

    The instance shares ``optimizer.state`` and copies the live hyper-parameters of the groups
    its parameters come from before every step. Runs on the autograd thread (with the GIL)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cls: type,
        params: list[nn.Parameter],
        group_of: list[int],
    ) -> None:
        self._optimizer = optimizer
        self._cls = cls
        self._params = params
        self._group_of = group_of
        self._instances: dict[tuple[int, ...], tuple[torch.optim.Optimizer, list[int]]] = {}
        self.calls = 0  # buckets stepped here (not by the fused kernels)

    def _instance(self, members: tuple[int, ...]) -> tuple[torch.optim.Optimizer, list[int]]:
        if members not in self._instances:
            by_group: dict[int, list[nn.Parameter]] = {}
            for i in members:
                by_group.setdefault(self._group_of[i], []).append(self._params[i])
            groups = sorted(by_group)
            param_groups = [
                {**_hyper_items(self._optimizer.param_groups[g]), "params": by_group[g]}
                for g in groups
            ]
            # The groups carry every hyper-parameter; the constructor also gets the defaults it
            # accepts (a class may require some), as the user's optimizer was built with.
            accepted = inspect.signature(self._cls.__init__).parameters
            defaults = {k: v for k, v in self._optimizer.defaults.items() if k in accepted}
            try:
                instance = self._cls(param_groups, **defaults)
            except Exception as exc:
                raise RuntimeError(
                    f"leanddp optimizer_in_backward: could not build a {self._cls.__name__} over "
                    f"one bucket's parameters as {self._cls.__name__}(param_groups, "
                    f"**defaults): {exc}"
                ) from exc
            self._instances[members] = (instance, groups)
        return self._instances[members]

    def __call__(self, index: int, members: list[int], grads: list[Tensor]) -> None:
        self.calls += 1
        instance, groups = self._instance(tuple(members))
        for k, g in enumerate(groups):
            instance.param_groups[k].update(_hyper_items(self._optimizer.param_groups[g]))
        instance.state = self._optimizer.__dict__["state"]
        params = [self._params[i] for i in members]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        try:
            instance.step()
        finally:
            for p in params:
                p.grad = None


def _hyper_items(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


# ------------------------------------------------------------------------------------------
# the facade: the user's optimizer, whose step() is a no-op and whose state is the fused state

_FACADES: dict[type, type] = {}


def _base_class(optimizer: torch.optim.Optimizer) -> type:
    return _base_class_of(type(optimizer))


def _base_class_of(cls: type) -> type:
    return cls.__bases__[0] if getattr(cls, "_leanddp_in_backward", False) else cls


def _facade_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """Steps nothing: with optimizer_in_backward every bucket is stepped inside backward. A
    closure, if given, is evaluated (it runs forward and backward, which step). Then makes the
    steps' updates visible, so that code reading the parameters after ``step()`` (an EMA, a
    norm, a copy of ``parameters()``) sees them, as after torch's step: with offload_to_cpu the
    host waits for the host steps and the copies back and raises an error a host step met; on
    a GPU without it the current stream is ordered after the steps (the host does not wait).

    Called by ``GradScaler.step`` (which set ``self.found_inf``, this class advertising
    ``_step_supports_amp_scaling``): hands the scaler this iteration's device-side found_inf,
    which ``scaler.update()`` then reads."""
    if "found_inf" in self.__dict__:
        link = self.__dict__.get("_leanddp_link")
        scaler = link.scaler if link is not None else None
        if scaler is None or link.found_inf is None:
            raise RuntimeError(
                "leanddp optimizer_in_backward: GradScaler.step(ddp.optimizer) was called, but "
                "the gradients were stepped inside backward without the scaler: pass "
                "grad_scaler=<the GradScaler> to leanddp.DistributedDataParallel"
            )
        state = scaler._per_optimizer_states[id(self)]
        state["found_inf_per_device"] = {link.found_inf.device: link.found_inf}
    result = None
    if closure is not None:
        with torch.enable_grad():
            result = closure()
    link = self.__dict__.get("_leanddp_link")
    if link is not None:
        link.wait_for_steps()
    return result


def _facade_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's ``state_dict()``. With shard_optimizer_state the state is first gathered from
    every rank's shard: a collective, so every rank calls it (at the same point of the loop),
    and every rank gets the whole state, loadable by the plain torch optimizer."""
    link = self.__dict__.get("_leanddp_link")
    base = _base_class(self)
    if link is None or not link.sharded:
        return base.state_dict(self)
    held = self.__dict__["state"]
    link.loading = True  # optimizer.state is the gathered one for the moment
    try:
        self.__dict__["state"] = collections.defaultdict(dict, link.gathered_state())
        return base.state_dict(self)
    finally:
        self.__dict__["state"] = held
        link.loading = False


def _facade_add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    raise NotImplementedError(
        "leanddp optimizer_in_backward: parameter groups cannot be added after wrapping; build "
        "the optimizer with all its groups in the factory"
    )


def _facade_state_get(self: torch.optim.Optimizer) -> Any:
    link = self.__dict__.get("_leanddp_link")
    if link is not None:
        link.sync_state()
    return self.__dict__["state"]


def _facade_state_set(self: torch.optim.Optimizer, value: Any) -> None:
    self.__dict__["state"] = value


def _make_facade(optimizer: torch.optim.Optimizer, link: InBackward) -> None:
    cls = _base_class(optimizer)
    if cls not in _FACADES:
        _FACADES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_leanddp_in_backward": True,
                "_step_supports_amp_scaling": True,  # GradScaler.step: see _facade_step
                "step": _facade_step,
                "add_param_group": _facade_add_param_group,
                "state_dict": _facade_state_dict,
                "state": property(_facade_state_get, _facade_state_set),
            },
        )
    optimizer.__class__ = _FACADES[cls]
    optimizer.__dict__["_leanddp_link"] = link
    optimizer.register_load_state_dict_pre_hook(_before_load)
    optimizer.register_load_state_dict_post_hook(_after_load)


def _before_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    link = optimizer.__dict__.get("_leanddp_link")
    if link is not None:
        link.loading = True


def _after_load(optimizer: torch.optim.Optimizer) -> None:
    link = optimizer.__dict__.get("_leanddp_link")
    if link is not None:
        link.load_state()


# ------------------------------------------------------------------------------------------
# clipping: gradients of in-backward parameters are gone by the time user code could clip

_GUARDED: dict[int, weakref.ref] = {}
#: The clipping functions of torch.nn.utils.clip_grad that take parameters (clip_grad_norm and
#: torch.nn.utils.clip_grads_with_norm_ call these at call time).
_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_", "_clip_grads_with_norm_")


def guard_clipping(params: Sequence[nn.Parameter]) -> None:
    """Makes torch.nn.utils' clipping functions raise when given these parameters: with
    optimizer_in_backward their gradients were stepped and released inside backward, and
    clipping nothing would silently train unclipped.

    The guard goes inside the function objects themselves, so that a reference taken before
    wrapping (``from torch.nn.utils import clip_grad_norm_``) is guarded too: torch's clipping
    functions are ``_no_grad`` wrappers that look up the function they wrap in a closure cell
    at call time, and that cell is pointed at the guarded function. Where a torch version
    builds them otherwise, the module attributes are replaced instead; clip_grad_norm_ then
    stays guarded through ``_clip_grads_with_norm_``, which it looks up at call time."""
    for p in params:
        key = id(p)
        _GUARDED[key] = weakref.ref(p, lambda _, key=key: _GUARDED.pop(key, None))
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in _CLIP_FUNCTIONS:
        fn = getattr(clip_grad, name, None)
        if fn is None or _guard_inside(fn, name):
            continue
        guarded = _guarded(fn, name)  # torch changed its wrappers: replace the attributes
        for module in (utils, clip_grad):
            for attr in (name, name.lstrip("_")):
                if getattr(module, attr, None) is fn:
                    setattr(module, attr, guarded)


def _guard_inside(fn: Callable[..., Any], name: str) -> bool:
    """Points the closure cell holding the function a ``_no_grad`` wrapper calls at a guarded
    version of it; False if ``fn`` is not built that way."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    cells = [
        c
        for var, c in zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=True)
        if var == "func" and callable(c.cell_contents)
    ]
    if len(cells) != 1:
        return False
    if not getattr(cells[0].cell_contents, "_leanddp_guard", False):
        cells[0].cell_contents = _guarded(cells[0].cell_contents, name.lstrip("_"))
    return True


def _guarded(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        for p in params:
            ref = _GUARDED.get(id(p))
            if ref is not None and ref() is p:
                raise RuntimeError(
                    f"torch.nn.utils.{name}: these parameters are trained by leanddp's "
                    "optimizer_in_backward, which steps each bucket inside backward and "
                    "releases its gradients: there is nothing left to clip, and clipping here "
                    "would silently do nothing. For exact global-norm clipping use "
                    "offload_to_cpu=True with max_grad_norm=...; or train without "
                    "optimizer_in_backward (see docs/ddp.md, 'Gradient clipping')."
                )
        return fn(params, *args, **kwargs)

    wrapper._leanddp_guard = True  # type: ignore[attr-defined]
    return wrapper

"""optimizer_in_backward's Python glue: where parameters are read or written, wait for the steps.

The steps of a backward may still be running after backward returns: on a GPU they are queued
on a side stream (the stream that called backward is ordered after them, the host does not wait),
and with offload_to_cpu the host worker finishes them. ``DistributedDataParallel.forward`` waits
for them. So that code using the parameters another way sees the stepped weights too (and does
not race with the writes), the wrapped module waits before its own forward (called directly, as
evaluation code often does), and every module that owns a trained parameter waits before its
``state_dict()`` and ``load_state_dict()``. (With offload_to_cpu the worker is stopped when the
wrapper is collected or at interpreter exit: see ``Reducer.close``.)

With offload_to_cpu the wrapper's forward does not wait for every host step at its start: it
waits for each bucket when the forward first reads one of the bucket's parameters, so the
forward's first layers run while the worker still steps the last ones (it steps the first layers'
buckets first). A read is seen two ways: a module's forward pre-hook waits for the parameters
the module owns, and a torch function mode (:class:`ReadWaits`) sees every torch function and
tensor method the forward calls, so a parameter read outside its owner's forward
(``nn.MultiheadAttention`` reading ``out_proj.weight``, a tied or functional use in a parent) is
waited for too. The rest is waited for at the end of the forward. With no host step pending the
forward does not wait for the worker at all, which may still be summing the last no_sync()
micro-batch (accumulate_on_host): no forward reads those sums. Where torch functions may not
be seen (a forward being compiled, a compiled or scripted submodule) the forward waits for
everything at its start instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from ._extension import _C


class Waits:
    """The waits of one wrapper: hooks on ``module`` for the parameters ``trained`` that
    ``core`` (a ``_C.InBackwardOptimizer``) steps, in the order of ``reducer`` (a
    ``_C.Reducer``, whose buckets it steps). The hooks hold both weakly: once the wrapper is
    gone they do nothing."""

    def __init__(
        self, module: nn.Module, trained: Sequence[Tensor], reducer: _C.Reducer, core: Any
    ) -> None:
        self._reducer = weakref.ref(reducer)
        self._core = weakref.ref(core)
        self._module = module
        self._trained = list(trained)
        # While a forward waits per bucket: id(parameter) -> its bucket, for the buckets whose
        # host steps are pending, and each such bucket's ids. (A trained parameter is alive as
        # long as this object, so its id is no other object's.)
        self._bucket_of: dict[int, int] = {}
        self._members: dict[int, list[int]] = {}
        self.active = False
        self._handles = [module.register_forward_pre_hook(self._before_module_forward)]
        ids = {id(p) for p in trained}
        for sub in module.modules():
            owned = [id(p) for p in sub.parameters(recurse=False) if id(p) in ids]
            if not owned:
                continue
            self._handles.append(sub.register_forward_pre_hook(self._owner_hook(owned)))
            self._handles.append(sub.register_state_dict_pre_hook(self._before_state_dict))  # type: ignore[no-untyped-call]  # unannotated in torch
            self._handles.append(sub.register_load_state_dict_pre_hook(self._before_state_dict))  # type: ignore[no-untyped-call]  # unannotated in torch

    def remove(self) -> None:
        """Removes the hooks (the wrapper built a new Reducer)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin(self, pending: Sequence[int], compiling: bool) -> ReadWaits | None:
        """At the wrapper's forward, before the module: the mode that waits per bucket for the
        host steps ``pending`` (the optimizer's ``pending_steps``, which ordered the forward after
        the copies back of the other buckets), or None where the caller must wait for all of
        them (nothing pending, or torch functions may not be seen: ``compiling``, a compiled or
        scripted submodule)."""
        reducer = self._reducer()
        if reducer is None or self._core() is None:
            return None
        if not pending or compiling or _opaque(self._module):
            return None
        layout = reducer.bucket_indices()
        self._bucket_of.clear()
        self._members.clear()
        for b in pending:
            ids = [id(self._trained[i]) for i in layout[b]]
            self._members[b] = ids
            self._bucket_of.update((i, b) for i in ids)
        return ReadWaits(self)

    def _wait(self, b: int) -> None:
        """Waits for pending bucket ``b``'s host step; its parameters are pending no more."""
        core = self._core()
        if core is not None:
            core.wait_for_bucket(b)
        for i in self._members.pop(b):
            del self._bucket_of[i]

    def read_all(self, values: Iterable[object]) -> None:
        """What a torch function is given: each argument, and the members of a list or tuple."""
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value:
                    if id(item) in self._bucket_of:
                        self._wait(self._bucket_of[id(item)])
            elif id(value) in self._bucket_of:
                self._wait(self._bucket_of[id(value)])

    def end(self) -> None:
        self.active = False
        self._bucket_of.clear()
        self._members.clear()

    def _before_module_forward(self, module: nn.Module, args: Any) -> None:
        core = self._core()
        if core is not None and not self.active:  # called directly, or nothing pending
            core.follow_steps()  # (waits for every step if one is pending)

    def _owner_hook(self, owned: list[int]) -> Any:
        def before_forward(module: nn.Module, args: Any) -> None:
            if self._bucket_of:
                for i in owned:
                    if i in self._bucket_of:
                        self._wait(self._bucket_of[i])

        return before_forward

    def _before_state_dict(self, module: nn.Module, *args: Any) -> None:
        core = self._core()
        if core is not None:
            core.wait_for_steps(host_too=True)


class ReadWaits(TorchFunctionMode):
    """Active around the wrapped module's forward: before each torch function or tensor method,
    waits for the pending host step of every parameter among its arguments."""

    def __init__(self, waits: Waits) -> None:
        super().__init__()
        self._waits = waits

    def __enter__(self) -> ReadWaits:
        self._waits.active = True
        return super().__enter__()  # type: ignore[no-untyped-call, no-any-return]  # unannotated in torch

    def __exit__(self, *exc: Any) -> None:
        self._waits.end()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # unannotated in torch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._waits._bucket_of:
            self._waits.read_all(args)
            if kwargs:
                self._waits.read_all(kwargs.values())
        return func(*args, **kwargs)


def _opaque(module: nn.Module) -> bool:
    """Whether some of ``module``'s forward may run without calling torch functions in Python:
    a compiled or scripted submodule."""
    compiled = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    return any(
        isinstance(m, (torch.jit.ScriptModule, compiled))
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )

"""optimizer_in_backward: the fused state seen as ``optimizer.state``, and writes to it.

The fused kernels keep a parameter's optimizer state in leanddp's own buffers (flat per-bucket
buffers on the device, or host buffers with offload_to_cpu); ``optimizer.state[p]`` holds
views of them (:class:`StateView`). Code may also *replace* what it holds, as it may with a
plain torch optimizer: Lightning moves a loaded state to the root device with
``optimizer.state[p] = {k: v.to(device) ...}`` or ``state[p][k] = v.to(device)``, and user code
writes ``state[p]["exp_avg"] = t``. Such a write is adopted before the next in-backward step:
the new values are copied into leanddp's buffers and ``state[p]`` points at them again, so the
write counts and no memory is doubled. Detection compares, once per forward, the identity of
each entry and its tensors with those handed out (no tensor is read, and while the state holds
exactly what it held at the last forward, one pass over it in C); a value that cannot be
adopted raises, naming the parameter and the key, before anything is copied.

What state a parameter has (its keys, their dtype and device, whether the kernels step it at
all) is the fused optimizer's rule, asked from C++ (``leanddp._C.state_spec``, :meth:`spec`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from .._extension import _C
from . import _lowbit


class StateView:
    """Points ``optimizer.state`` at the fused state and adopts what code wrote there instead.

    ``given[i]``: the entry (a dict) last put into ``optimizer.state`` for parameter ``i`` and
    its values, or None where none was (no state yet). Changes whenever the entries are
    rebuilt (:meth:`sync`), which happens when the optimizer's generation changes."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        kind: _C.OptimKind | None,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_of: Sequence[int],
        offload: bool,
        sharded: bool = False,
        block: int = 0,
    ) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self.params = params
        self.names = names
        self.group_of = group_of
        self.offload = offload
        self.block = block  # the 8-bit kind's block size (torchao's block_size)
        # per parameter: whether the fused kernels step it (else the fallback does); fixed
        self.fused = [kind is not None and self.spec(i).stepped for i in range(len(params))]
        # shard_optimizer_state: no rank holds a parameter's whole state, so optimizer.state
        # holds none (state_dict() gathers it); what code writes there is adopted, then dropped.
        self.sharded = sharded
        self.generation = -1
        self.given: list[tuple[dict[str, Any], tuple[Any, ...]] | None] = [None] * len(params)
        # optimizer.state's entries and their values, in order, when it was last known to hold
        # no replaced entry (mark()): while it still holds exactly these, nothing was replaced.
        self.marked: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def spec(self, i: int) -> _C.StateSpec:
        """Parameter ``i``'s state as the fused optimizer keeps it (``leanddp._C.StateSpec``:
        whether the kernels step it; its keys, dtype and device), with its group's momentum as
        it is now (SGD keeps a buffer only with momentum). Needs a fused kind."""
        momentum = self.optimizer.param_groups[self.group_of[i]].get("momentum", 0) != 0
        assert self.kind is not None  # (asked only where the kernels step)
        return _C.state_spec(
            self.kind, self.params[i], on_host=self.offload, momentum=momentum, block=self.block
        )

    def entry(self, i: int, entries: Sequence[tuple[str, Tensor]]) -> dict[str, Any]:
        """Parameter ``i``'s fused state ``entries`` (``_C.InBackwardOptimizer.state``, or
        gathered from the shards) as its ``optimizer.state`` entry: torch's format, or for the
        8-bit kind torchao's (:func:`_lowbit.to_torchao`)."""
        if self.kind == _C.OptimKind.adam8bit:
            return _lowbit.to_torchao(entries, self.spec(i), self.params[i])
        return dict(entries)

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        state: dict[Any, dict[str, Any]] = self.optimizer.__dict__["state"]
        return state

    def sync(self, core: _C.InBackwardOptimizer, adopt: bool = True) -> None:
        """Re-points the entries at the fused state if it was created, moved or loaded since the
        last call (a replaced entry is adopted first, ``adopt``: its values would be lost)."""
        generation = core.generation()
        if generation == self.generation:
            return
        if adopt:
            self.adopt(core)
            generation = core.generation()
        state = self.state
        for i, p in enumerate(self.params):
            if self.fused[i] and self.sharded:
                state.pop(p, None)
                self.given[i] = None
            elif self.fused[i]:
                entries = core.state(i)
                if entries:
                    entry = self.entry(i, entries)
                    state[p] = entry
                    self.given[i] = (entry, tuple(entry.values()))
        self.generation = generation

    def mark(self) -> None:
        """Records ``optimizer.state`` as holding no replaced entry (just after an adopt and a
        sync), for :meth:`unchanged`."""
        entries = tuple(self.state.values())
        try:
            self.marked = (entries, tuple(chain.from_iterable(map(dict.values, entries))))
        except TypeError:  # an entry that is not a dict: no fast path
            self.marked = None

    def unchanged(self) -> bool:
        """Whether ``optimizer.state`` holds the same entries and values, by identity, as at the
        last :meth:`mark` (C-level iteration only: no tensor hashing, no loop in Python)."""
        if self.marked is None:
            return False
        entries, values = self.marked
        state = self.state
        if len(state) != len(entries) or not all(map(operator.is_, state.values(), entries)):
            return False
        now = tuple(chain.from_iterable(map(dict.values, entries)))
        return len(now) == len(values) and all(map(operator.is_, now, values))

    def replaced(self) -> list[int]:
        """The fused parameters whose ``optimizer.state`` entry is not the one handed out: the
        dict replaced, or a key of it replaced, added or removed (identity checks only)."""
        state = self.state
        out = []
        for i, p in enumerate(self.params):
            if not self.fused[i]:
                continue
            entry = state.get(p)
            given = self.given[i]
            if given is None:
                if entry:  # written where leanddp had no state yet
                    out.append(i)
            elif (
                entry is not given[0]
                or len(entry) != len(given[1])
                or not all(map(operator.is_, entry.values(), given[1]))
            ):
                out.append(i)
        return out

    def adopt(self, core: _C.InBackwardOptimizer) -> bool:
        """Copies replaced entries into the fused state (all checked first: a value that cannot
        be adopted raises before any is copied). Returns whether any was."""
        if self.unchanged():
            return False
        indices = self.replaced()
        if not indices:
            return False
        for i, entry in zip(indices, self._check_and_load(core, indices), strict=True):
            # (re-pointed by the next sync where the fused state exists; else it stays this one)
            self.given[i] = None if entry is None else (entry, tuple(entry.values()))
        return True

    def _check_and_load(
        self,
        core: _C.InBackwardOptimizer,
        indices: list[int],
        saved: dict[int, dict[str, Any]] | None = None,
    ) -> list[dict[str, Any] | None]:
        """Checks the ``optimizer.state`` entries of these parameters, all before any is copied,
        then copies them into the fused state; returns the entries (None where absent).
        ``saved[i]``: tensors to take instead of the entry's values of the same keys (the state
        as saved, before torch's load cast it)."""
        entries = [self.state.get(self.params[i]) for i in indices]
        if saved:
            entries = [
                e if not e or i not in saved else {k: saved[i].get(k, v) for k, v in e.items()}
                for i, e in zip(indices, entries, strict=True)
            ]
        for i, entry in zip(indices, entries, strict=True):
            self.check(i, entry or {})
        for i, entry in zip(indices, entries, strict=True):
            self.load(core, i, entry or {})
        return entries

    def load_all(
        self, core: _C.InBackwardOptimizer, saved: dict[int, dict[str, Any]] | None = None
    ) -> None:
        """Copies what ``optimizer.state`` holds for every fused parameter into the fused state
        (after ``load_state_dict``; ``saved``: see :meth:`_check_and_load`) and points the
        entries at it."""
        self._check_and_load(core, [i for i, f in enumerate(self.fused) if f], saved)
        self.generation = -1
        self.sync(core, adopt=False)

    def _fail(self, i: int, key: str, message: str) -> NoReturn:
        raise ValueError(
            f"leanddp.DistributedDataParallel: optimizer_in_backward: optimizer.state of "
            f"parameter {self.names[i]!r}, key {key!r}: {message}"
        )

    def check(self, i: int, entry: dict[str, Any]) -> None:
        """Raises a ValueError naming the parameter and the key where ``entry`` cannot become
        parameter ``i``'s fused state."""
        p = self.params[i]
        spec = self.spec(i)
        tensors = []
        if spec.counted:  # a state with a step count: all its keys, or none (starting over)
            counted = ["step", *spec.buffers]
            if any(key in entry for key in counted):
                for key in counted:
                    if key not in entry:
                        self._fail(i, key, f"missing (this state holds {', '.join(counted)})")
                step = entry["step"]
                try:
                    count = float(step)
                except (TypeError, ValueError, RuntimeError):
                    self._fail(i, "step", f"expected a number or one-element tensor, got {step!r}")
                if count < 0 or count != int(count):
                    self._fail(i, "step", f"expected a non-negative whole number, got {count}")
                tensors = list(spec.buffers)
        elif self._holds_buffers(spec, entry):
            tensors = list(spec.buffers)
        if spec.master and "master_weight" in entry:
            tensors.append("master_weight")
        for key in tensors:
            value = entry[key]
            if not isinstance(value, Tensor):
                self._fail(i, key, f"expected a tensor, got {type(value).__name__}")
            if value.shape != p.shape:
                shapes = f"{tuple(value.shape)}, the parameter's {tuple(p.shape)}"
                self._fail(i, key, f"shape {shapes}: they must be equal")
            if not value.is_floating_point():
                self._fail(i, key, f"expected a floating-point tensor, got {value.dtype}")

    def load(self, core: _C.InBackwardOptimizer, i: int, entry: dict[str, Any]) -> None:
        """Copies ``entry`` (checked) into parameter ``i``'s fused state; an empty entry resets it,
        as a plain torch optimizer starts over from an empty ``state[p]``."""
        spec = self.spec(i)
        if spec.master and "master_weight" in entry:
            core.load_master_weight(i, entry["master_weight"])
        if spec.counted:
            if any(key in entry for key in ("step", *spec.buffers)):
                values = [entry[key] for key in spec.buffers]
                if self.kind == _C.OptimKind.adam8bit:
                    values = _lowbit.load_values(spec, values, self.params[i])
                core.load_state(i, int(float(entry["step"])), values)
                return
            # Starting over: the first step reads the buffers as zeros (Adam's moments; 8-bit
            # codes and scales of zero are zero moments), so the values held so far must not
            # survive in leanddp's buffers (a count of 0 alone keeps them).
            zeros = [
                torch.zeros_like(value)
                for key, value in core.state(i)
                if key not in ("step", "master_weight")
            ]
            if zeros:
                core.load_state(i, 1, zeros)
            core.load_state(i, 0, [])
            return
        # Without a count (SGD's momentum buffer), the first step overwrites the buffers.
        if self._holds_buffers(spec, entry):
            core.load_state(i, 1, [entry[key] for key in spec.buffers])
        else:
            core.load_state(i, 0, [])

    @staticmethod
    def _holds_buffers(spec: _C.StateSpec, entry: dict[str, Any]) -> bool:
        """Whether ``entry`` holds every state buffer of ``spec`` (and ``spec`` has some)."""
        return bool(spec.buffers) and all(entry.get(key) is not None for key in spec.buffers)

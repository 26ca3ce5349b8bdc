"""optimizer_in_backward's fallback: buckets the fused kernels do not step.

Another optimizer class, an option the kernels lack, a float64 parameter or one with gaps or
overlaps (a strided slice): the Reducer hands such a bucket's parameters and gradient views to
:class:`FallbackStepper` (csrc/bucket_stepper.h, with the GIL), which steps them with a per-bucket
instance of the user's class sharing ``optimizer.state``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn


class FallbackStepper:
    """Steps a bucket's parameters with a per-bucket instance of the user's optimizer class.

    The instance shares ``optimizer.state`` and copies the live hyper-parameters of the groups
    its parameters come from before every step. Runs on the autograd thread (with the GIL)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cls: type[torch.optim.Optimizer],
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
            # accepts (a class may require some), as the user's optimizer was built with, and
            # the settings it accepts that the optimizer keeps as attributes, not in its groups
            # (torchao's block_size and bf16_stochastic_round).
            accepted = inspect.signature(self._cls.__init__).parameters
            defaults = {k: v for k, v in self._optimizer.defaults.items() if k in accepted}
            attributes = vars(self._optimizer)
            for name in accepted:
                if name not in defaults and name not in ("self", "params") and name in attributes:
                    defaults[name] = attributes[name]
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
        """Steps bucket ``index``'s parameters ``members`` with their gradients ``grads``."""
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

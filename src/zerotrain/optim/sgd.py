"""SGD with optional (Nesterov) momentum on flat tensors, via torch's fused kernel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.sgd import sgd as torch_sgd

from zerotrain.optim.base import FlatOptimizer


class SGD(FlatOptimizer):
    """SGD with the semantics of ``torch.optim.SGD`` (L2 weight decay, dampening, Nesterov).

    Args:
        params: flat tensors (or param-group dicts) whose ``.grad`` holds the gradient.
        lr: learning rate.
        momentum: momentum factor (0 disables momentum).
        dampening: dampening of the momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        # The momentum buffer is created by the first step (it starts as the gradient).
        return {"momentum_buffer": None}

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        torch_sgd(
            params,
            [p.grad for p in params],  # type: ignore[misc]
            buffers,
            fused=fused,
            foreach=None if fused else True,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=False,
        )
        if group["momentum"] != 0:
            for p, buf in zip(params, buffers, strict=True):
                self.state[p]["momentum_buffer"] = buf

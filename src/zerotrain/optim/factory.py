"""Build the optimizer and schedule named in the config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotrain.config.policies import OptimizerSpec, SchedulerSpec
from zerotrain.optim.adam import Adam
from zerotrain.optim.base import FlatOptimizer
from zerotrain.optim.lamb import Lamb, NormReducer
from zerotrain.optim.schedulers import SCHEDULERS
from zerotrain.optim.sgd import SGD

# Config keys that choose a kernel in DeepSpeed; zerotrain chooses its own.
_INERT_KEYS = ("torch_adam", "fused")


@dataclass
class FlatGroup:
    """One optimizer param group over flat tensors.

    ``segments[i]`` lists the ``(start, end)`` span of every original parameter inside
    ``tensors[i]`` (LAMB needs them); ``options`` overrides the config's hyperparameters.
    """

    tensors: list[torch.Tensor]
    segments: list[tuple[tuple[int, int], ...]]
    options: dict[str, Any] = field(default_factory=dict)


def _hyperparameters(spec: OptimizerSpec) -> dict[str, Any]:
    hyper = {k: v for k, v in spec.params.items() if k not in _INERT_KEYS}
    if spec.name == "adamw":
        hyper["adam_w_mode"] = True
    return hyper


def check_group_options(spec: OptimizerSpec, options: Sequence[Mapping[str, Any]]) -> None:
    """Reject param-group options the optimizer does not have (a typo would be ignored)."""
    allowed = sorted(_hyperparameters(spec))
    for i, group in enumerate(options):
        unknown = sorted(set(group) - set(allowed))
        if unknown:
            raise ValueError(
                f"model_parameters group {i} sets {', '.join(map(repr, unknown))}, which "
                f"{spec.name} does not have; allowed: {', '.join(allowed)}"
            )


def build_optimizer(
    spec: OptimizerSpec, groups: Sequence[FlatGroup], norm_reducer: NormReducer | None = None
) -> FlatOptimizer:
    """The optimizer ``spec`` names, over ``groups`` of flat tensors."""
    hyper = _hyperparameters(spec)
    check_group_options(spec, [g.options for g in groups])
    param_groups = [{"params": g.tensors, "segments": g.segments, **g.options} for g in groups]
    if spec.name in ("adam", "adamw"):
        for g in param_groups:
            g.pop("segments")
        return Adam(param_groups, **hyper)
    if spec.name == "sgd":
        for g in param_groups:
            g.pop("segments")
        return SGD(param_groups, **hyper)
    if spec.name == "lamb":
        return Lamb(param_groups, norm_reducer=norm_reducer, **hyper)
    raise ValueError(f"optimizer '{spec.name}' is not implemented")


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> Any:
    """The learning-rate schedule ``spec`` names, driving ``optimizer``."""
    if spec.name not in SCHEDULERS:
        raise ValueError(f"scheduler '{spec.name}' is not implemented")
    return SCHEDULERS[spec.name](optimizer, **spec.params)

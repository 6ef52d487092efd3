"""Which parameters the optimizer updates, in which groups, with which options.

``initialize`` accepts what DeepSpeed accepts: ``model_parameters`` as an iterable of
parameters or of param-group dicts, a ready torch optimizer (its groups are used), or
nothing (every trainable parameter, one group). Everything is checked: a parameter that is
not part of the model, or listed twice, is an error rather than a silent surprise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerotrain.utils.logging import get_logger
from zerotrain.zero.units import TrainableParam

log = get_logger(__name__)


@dataclass
class ParamGroups:
    """The resolved groups: ``options[g]`` are group g's hyperparameter overrides and
    ``trainable`` every parameter that gets a gradient, tagged with its group."""

    options: list[dict[str, Any]] = field(default_factory=list)
    trainable: list[TrainableParam] = field(default_factory=list)


def _as_group_dicts(model_parameters: Any) -> list[dict[str, Any]]:
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty")
    if all(isinstance(item, dict) for item in items):
        groups = []
        for i, item in enumerate(items):
            if "params" not in item:
                raise ValueError(f"model_parameters group {i} has no 'params' key")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            groups.append({**item, "params": params})
        return groups
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise TypeError(
        "model_parameters must be an iterable of parameters or of param-group dicts "
        "({'params': [...], 'lr': ...}), not a mix"
    )


def resolve_param_groups(
    model: nn.Module,
    model_parameters: Iterable[Any] | None,
    optimizer: torch.optim.Optimizer | None,
) -> ParamGroups:
    """Assign every trainable parameter of ``model`` to an optimizer group (or to none).

    Raises:
        ValueError: a listed parameter is not in the model, or is listed twice.
    """
    named = list(model.named_parameters())
    index = {id(p): (pos, name) for pos, (name, p) in enumerate(named)}
    if optimizer is not None:
        raw_groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        raw_groups = _as_group_dicts(model_parameters)
    else:
        raw_groups = [{"params": [p for _, p in named]}]

    result = ParamGroups()
    owner: dict[int, int] = {}
    for g, group in enumerate(raw_groups):
        for param in group["params"]:
            if id(param) not in index:
                raise ValueError(
                    f"parameter group {g} holds a tensor of shape {tuple(param.shape)} that is "
                    "not a parameter of the model given to initialize"
                )
            if id(param) in owner:
                raise ValueError(
                    f"parameter '{index[id(param)][1]}' appears in groups {owner[id(param)]} "
                    f"and {g}; each parameter belongs to one group"
                )
            owner[id(param)] = g
        result.options.append({k: v for k, v in group.items() if k != "params"})

    for pos, (name, param) in enumerate(named):
        if not param.requires_grad:
            continue  # frozen: left exactly as it is
        group_index = owner.get(id(param))
        if group_index is None:
            log.warning(
                "parameter '%s' requires grad but is in no optimizer group: its gradient is "
                "averaged across ranks but it is never updated",
                name,
            )
        result.trainable.append(TrainableParam(name, param, group_index, pos))
    return result

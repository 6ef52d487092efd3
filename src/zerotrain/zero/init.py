"""``zerotrain.zero.Init``: build a model whose parameters are never whole on one rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_RECIPE = "_zerotrain_recipe"


def deferred_values(model: nn.Module) -> Callable[[nn.Parameter], torch.Tensor] | None:
    """How to compute the values of a model built by ``Init`` (None for an ordinary model)."""
    if not any(hasattr(p, _RECIPE) for p in model.parameters()):
        return None
    return lambda param: getattr(param, _RECIPE).replay()


def materialize(model: nn.Module) -> None:
    """Give every parameter of a model built by ``Init`` its full value."""
    with torch.no_grad():
        for param in model.parameters():
            recipe = getattr(param, _RECIPE, None)
            if recipe is not None:
                param.data = recipe.replay()
                delattr(param, _RECIPE)

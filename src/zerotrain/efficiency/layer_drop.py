"""Progressive layer drop (PLD, https://arxiv.org/abs/2010.13369), DeepSpeed's semantics.

Each training forward, layer ``l`` of ``L`` runs with probability ``1 - l/L * (1 - theta)``
where theta falls from 1.0 towards the configured ``theta`` as ``(1 - theta) *
exp(-gamma * t) + theta``, ``t`` the optimizer steps taken before the previous update
(DeepSpeed updates theta at each step with the step count before incrementing it, so the
first two steps run every layer).

Convention, for pre-LN residual blocks ``y = x + f(x)``: a dropped block is the identity
(``y = x``), a kept one is rescaled to ``y = x + f(x) / p`` so that its expected output is
the plain block's; evaluation (``model.eval()``) runs every block unscaled. (Post-LN blocks
have no identity path to fall back to; the paper switches them to pre-LN.)

The block's class is swapped for a same-named subclass whose ``__call__`` decides before the
module's hooks run, so a dropped block fires none: at ZeRO stage 3 its parameters are not
gathered, and no gradient is produced for them (they are left untouched by the step, as
plain PyTorch leaves a parameter without a gradient). Names, ``state_dict`` keys and
``stage3_unit_classes`` matching are unchanged. Decisions come from
:func:`zerotrain.efficiency.draws.shared_generator`: every data-parallel rank drops the
same layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.efficiency.blocks import hidden_states_of, restore_class, swap_class
from zerotrain.efficiency.draws import shared_generator
from zerotrain.efficiency.schedules import keep_probability, pld_theta

_STREAM = 1  # the draw stream of layer drop (random-LTD uses another)


class ProgressiveLayerDrop:
    """Theta schedule and per-forward keep decisions (DeepSpeed's ProgressiveLayerDrop,
    plus the draws it left to model code).

    Args:
        theta: the keep probability the last layer settles at (1.0: nothing dropped).
        gamma: the decay rate of theta per optimizer step.
        seed: seeds the drop draws (the same on every rank).
    """

    def __init__(self, theta: float = 1.0, gamma: float = 0.001, seed: int = 0) -> None:
        self.theta = theta
        self.gamma = gamma
        self.seed = seed
        self.current_theta = 1.0
        self.blocks: list[nn.Module] = []
        # Per block, the parameters nothing outside it uses: a dropped block's get no
        # gradient (the engine tells the gradient reduction not to wait for them).
        self.exclusive_params: list[list[nn.Parameter]] = []
        self._kept: list[bool] | None = None

    def get_theta(self) -> float:
        """Theta for the next forward."""
        return self.current_theta

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments DeepSpeed passes a model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def update_state(self, global_step: int) -> None:
        """Called at each optimizer step with the step count before it is incremented."""
        self.current_theta = pld_theta(global_step, self.theta, self.gamma)

    def sync(self, global_steps: int) -> None:
        """Set theta for an engine that has taken ``global_steps`` steps, as the updates
        would have left it (1.0 before the first step): a resumed run continues exactly."""
        self.current_theta = (
            1.0 if global_steps == 0 else pld_theta(global_steps - 1, self.theta, self.gamma)
        )

    def keep_probabilities(self) -> list[float]:
        """Each wrapped block's keep probability at the current theta."""
        count = len(self.blocks)
        return [keep_probability(i + 1, count, self.current_theta) for i in range(count)]

    def dropped_params(self) -> list[nn.Parameter]:
        """The parameters only the blocks this forward drops use."""
        if self._kept is None or not self.exclusive_params:
            return []
        pairs = zip(self._kept, self.exclusive_params, strict=True)
        return [p for kept, params in pairs if not kept for p in params]

    def begin_forward(self, micro_step: int) -> list[nn.Module]:
        """Draw this training forward's decisions; returns the blocks it drops."""
        generator = shared_generator(self.seed, _STREAM, micro_step)
        draws = torch.rand(len(self.blocks), generator=generator)
        probs = self.keep_probabilities()
        self._kept = [bool(u < p) for u, p in zip(draws.tolist(), probs, strict=True)]
        return [b for b, kept in zip(self.blocks, self._kept, strict=True) if not kept]

    def end_forward(self) -> None:
        """Forget the decisions (a forward outside the engine runs every block)."""
        self._kept = None

    def decision(self, index: int) -> tuple[bool, float] | None:
        """Whether block ``index`` runs in this forward, and its keep probability; None
        outside an engine training forward."""
        if self._kept is None:
            return None
        prob = keep_probability(index + 1, len(self.blocks), self.current_theta)
        return self._kept[index], prob


@dataclass
class _Binding:
    controller: ProgressiveLayerDrop
    index: int
    extra_outputs: int = 0  # a tuple-returning block's outputs after the hidden states


class _LayerDropCall:
    """Mixed in front of a block's class: decides before ``nn.Module.__call__`` (hooks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding: _Binding | None = self.__dict__.get("_zt_layer_drop")
        training: bool = getattr(self, "training", False)
        decision = binding.controller.decision(binding.index) if binding and training else None
        if binding is None or decision is None:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        kept, prob = decision
        hidden = hidden_states_of(args, kwargs)
        if not kept:
            return (hidden,) + (None,) * binding.extra_outputs if binding.extra_outputs else hidden
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        if isinstance(out, tuple):
            binding.extra_outputs = len(out) - 1
            return (_rescaled(hidden, out[0], prob), *out[1:])
        return _rescaled(hidden, out, prob)


def _rescaled(hidden: Any, out: torch.Tensor, prob: float) -> torch.Tensor:
    """``x + (y - x) / p``: the residual update scaled by the inverse keep probability."""
    if prob == 1.0:
        return out
    return hidden + (out - hidden) / prob


def _exclusive_params(model: nn.Module, block: nn.Module) -> list[nn.Parameter]:
    """``block``'s parameters that no module outside it holds (a weight tied to another
    layer is not exclusive: the other layer still produces its gradient)."""
    inside = {id(m) for m in block.modules()}
    outside = {
        id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)
    }
    return [p for p in block.parameters() if id(p) not in outside]


def apply_layer_drop(
    blocks: Sequence[nn.Module], controller: ProgressiveLayerDrop, model: nn.Module | None = None
) -> None:
    """Make each of ``blocks`` (in depth order) drop itself as ``controller`` decides.
    ``model``: the whole model, to tell which parameters only the blocks use."""
    controller.blocks = list(blocks)
    if model is not None:
        controller.exclusive_params = [_exclusive_params(model, b) for b in blocks]
    for index, block in enumerate(blocks):
        swap_class(block, _LayerDropCall)
        block.__dict__["_zt_layer_drop"] = _Binding(controller, index)


def remove_layer_drop(blocks: Sequence[nn.Module]) -> None:
    """Undo :func:`apply_layer_drop`."""
    for block in blocks:
        block.__dict__.pop("_zt_layer_drop", None)
        restore_class(block, _LayerDropCall)

"""Loss scaling for fp16: small gradients survive the fp16 backward pass when the loss is
multiplied by ``scale`` first (and the gradients divided by it before the update).

Dynamic scaling follows DeepSpeed's rules step for step (checked against its
``DynamicLossScaler`` in tests/unit/test_loss_scaler.py), so configs behave as their authors
expect and a run moved between the two keeps its scale: a clean step doubles the scale when
the clean steps before it since the last overflow (or the start) are a positive multiple of
``window``, so the first doubling comes at the ``window + 1``-th clean step and then every
``window`` steps; on an overflow the step is skipped and the scale halves, except that
``hysteresis`` grants that many overflows of grace first (the grace is restored whenever the
scale grows, or after every clean step with ``consecutive_hysteresis``). The scale never
drops below ``min_scale``; an overflow that would take it lower stops training with
:class:`LossScaleError`, as DeepSpeed does (the model overflows at every scale, and skipping
steps forever would hide it).
"""

from __future__ import annotations

from typing import Any

from zerotrain.config.policies import LossScalePolicy


class LossScaleError(FloatingPointError):
    """Gradients overflow even at the smallest loss scale allowed."""


class LossScaler:
    """The current loss scale and the rule that moves it.

    Args:
        policy: static (``policy.static_scale``) or dynamic scaling and its knobs.
    """

    def __init__(self, policy: LossScalePolicy) -> None:
        self.policy = policy
        self.dynamic = policy.static_scale is None
        self.scale = policy.initial_scale if self.dynamic else float(policy.static_scale)  # type: ignore[arg-type]
        self.clean_steps = 0  # steps without overflow since the last overflow (or the start)
        self.grace = policy.hysteresis  # overflows still tolerated before the scale drops

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step (``overflow``: it was skipped)."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.grace > 1:
                self.grace -= 1
                return
            if self.scale <= self.policy.min_scale:
                raise LossScaleError(
                    f"gradients overflowed (inf/NaN) with the loss scale already at "
                    f"fp16.min_loss_scale ({self.policy.min_scale:g}): the model produces "
                    "non-finite gradients at every scale. Lower the learning rate, check the "
                    "data for inf/NaN, lower min_loss_scale, or train in bf16"
                )
            self.scale = max(self.scale / 2.0, self.policy.min_scale)
            return
        if self.policy.consecutive_hysteresis:
            self.grace = self.policy.hysteresis
        if self.clean_steps > 0 and self.clean_steps % self.policy.window == 0:
            self.scale *= 2.0
            self.grace = self.policy.hysteresis
        self.clean_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue scaling exactly where it stopped."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "grace": self.grace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        missing = {"scale", "clean_steps", "grace"} - set(state)
        if missing:
            raise KeyError(f"loss scaler state lacks {sorted(missing)}")
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.grace = int(state["grace"])

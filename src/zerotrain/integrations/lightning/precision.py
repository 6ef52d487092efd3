"""The precision plugin paired with ``ZeroTrainStrategy``: Lightning's hooks, the engine's math.

Casting, loss scaling and gradient clipping are the engine's (its config says which dtype,
``engine_config`` fills it from ``Trainer(precision=...)``), so this plugin converts nothing,
runs no autocast and clips nothing: doing any of it here as well would do it twice. What it
keeps from Lightning's plugin is the order of hooks around a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from zerotrain.integrations.lightning.config import SUPPORTED_PRECISION


class ZeroTrainPrecision(Precision):
    """Lightning's precision hooks without Lightning's precision math (the engine does it).

    Args:
        precision: Lightning's precision name; the strategy turns it into the engine's
            ``bf16`` / ``fp16`` section.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision {precision!r} is not available with zerotrain; use one of "
                f"{', '.join(SUPPORTED_PRECISION)}"
            )
        self.precision = precision  # type: ignore[assignment]

    @classmethod
    def adopt(cls, plugin: Precision) -> ZeroTrainPrecision:
        """This plugin for the precision the Trainer chose (its own plugin would cast the
        model or run autocast, which the engine does)."""
        if isinstance(plugin, ZeroTrainPrecision):
            return plugin
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
            raise TypeError(
                f"ZeroTrainStrategy cannot run with the precision plugin "
                f"{type(plugin).__name__}: pass Trainer(precision=...) instead"
            )
        return cls(str(plugin.precision))

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training step and backward) and the hooks that follow it; the
        strategy then steps the engine."""
        output = closure()
        self._after_closure(model, optimizer)
        if output is None and model.automatic_optimization:
            raise MisconfigurationException(
                "training_step returned None (skip the batch): ZeroTrainStrategy cannot skip "
                "the last micro-batch of an accumulation window"
            )
        return output

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Nothing: the engine clips the global norm (config ``gradient_clipping``, set
        from ``Trainer(gradient_clip_val=...)``) across every rank's shards."""

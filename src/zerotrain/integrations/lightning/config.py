"""The engine's config from the strategy's own and the Trainer's arguments (pure; no Lightning).

The Trainer owns accumulation, clipping and precision (``accumulate_grad_batches``,
``gradient_clip_val``, ``precision``); the engine is the one that applies them, exactly once.
A config that says something else for the same setting is refused rather than silently
overridden.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

# Lightning's precision names -> the config section that enables it. "-mixed" and "-true"
# mean the same to zerotrain: compute in the 16-bit dtype with fp32 master weights.
_SIXTEEN_BIT = {
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
_FULL = ("32-true", "32")
SUPPORTED_PRECISION = (*_FULL, *_SIXTEEN_BIT)


def load_strategy_config(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """A copy of the strategy's ``config=``: a DeepSpeed-style dict or a path to a JSON file.

    Raises:
        TypeError: ``config`` is neither.
        ValueError: the file does not hold a JSON object.
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"ZeroTrainStrategy(config={config!r}): the file must hold an object")
        return loaded
    raise TypeError(
        f"ZeroTrainStrategy(config=...) takes a dict or a path to a JSON file, got {config!r}"
    )


def _agree(cfg: dict[str, Any], key: str, value: Any, trainer_arg: str) -> None:
    """Set ``cfg[key]`` to the Trainer's ``value`` unless the config already says otherwise."""
    if key in cfg and cfg[key] != value:
        raise ValueError(
            f"the zerotrain config sets {key}={cfg[key]!r} but the Trainer's {trainer_arg} "
            f"gives {value!r}: set it in one place only (the Trainer's argument is the one "
            "Lightning's loop follows)"
        )
    cfg[key] = value


def engine_config(
    base: dict[str, Any],
    *,
    stage: int | None,
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
    precision: str,
) -> dict[str, Any]:
    """The DeepSpeed-style config given to ``zerotrain.initialize``.

    Args:
        base: the strategy's ``config=`` (not modified).
        stage: the strategy's ``stage=`` (None: the config's, else zerotrain's default).
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches=)``: the engine's
            ``gradient_accumulation_steps`` (the engine divides the loss by it, once).
        gradient_clip_val: ``Trainer(gradient_clip_val=)``: the engine's
            ``gradient_clipping`` (a global-norm clip over every rank's shards).
        gradient_clip_algorithm: ``Trainer(gradient_clip_algorithm=)``; only "norm" clips.
        precision: Lightning's precision name (``"32-true"``, ``"bf16-mixed"``, ...).

    Returns:
        A new dict; the micro-batch size defaults to 1 when the config gives none (it only
        counts samples: Lightning's data loader decides the real batch).

    Raises:
        ValueError: the config contradicts a Trainer argument, or the clip algorithm or
            the precision is one zerotrain does not have.
    """
    cfg = copy.deepcopy(base)
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroTrainStrategy(stage={stage!r}): the stage is 0, 1, 2 or 3")
        zero = cfg.setdefault("zero_optimization", {})
        if "stage" in zero and zero["stage"] != stage:
            raise ValueError(
                f"ZeroTrainStrategy(stage={stage}) but the config's zero_optimization.stage "
                f"is {zero['stage']}: give the stage in one place"
            )
        zero["stage"] = stage
    _agree(cfg, "gradient_accumulation_steps", accumulate_grad_batches, "accumulate_grad_batches")
    if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = 1
    if gradient_clip_val:
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"Trainer(gradient_clip_algorithm={gradient_clip_algorithm!r}): zerotrain "
                "clips the global gradient norm only; use 'norm'"
            )
        _agree(cfg, "gradient_clipping", float(gradient_clip_val), "gradient_clip_val")
    _set_precision(cfg, precision)
    return cfg


def _set_precision(cfg: dict[str, Any], precision: str) -> None:
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not available with zerotrain; use one of "
            f"{', '.join(SUPPORTED_PRECISION)}"
        )
    section = _SIXTEEN_BIT.get(precision)
    if section is None:
        return  # 32-bit Trainer: the config's own bf16/fp16 section (if any) decides
    other = "fp16" if section == "bf16" else "bf16"
    if cfg.get(other, {}).get("enabled", False):
        raise ValueError(
            f"Trainer(precision={precision!r}) but the config enables {other}: give the "
            "precision in one place"
        )
    cfg.setdefault(section, {})["enabled"] = True

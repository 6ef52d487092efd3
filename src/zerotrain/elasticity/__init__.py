"""DeepSpeed's ``deepspeed.elasticity`` import path: ``compute_elastic_config`` (what
schedulers and ``ds_elastic`` call), ``elasticity_enabled`` and the error classes. The plan
itself is ``zerotrain.config.elastic_batch``; the engine applies it at ``initialize``."""

from __future__ import annotations

import os
from typing import Any

from zerotrain.config.elastic_batch import (
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    plan_elastic_batch,
)
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config

__all__ = [
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
]


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or invalid."""


def elasticity_enabled(ds_config: dict[str, Any]) -> bool:
    """Whether ``ds_config`` has an enabled ``elasticity`` section."""
    return bool(ds_config.get("elasticity", {}).get("enabled", False))


def compute_elastic_config(
    ds_config: dict[str, Any],
    target_deepspeed_version: str,
    world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[Any, ...]:
    """DeepSpeed's call: ``(train_batch_size, valid_world_sizes)`` of the config's elastic
    plan, with the micro-batch size as a third value when ``world_size`` (> 0, the
    data-parallel world size; version 0.2 reads ``WORLD_SIZE`` without one, as DeepSpeed
    does) is given or ``return_microbatch``. ``target_deepspeed_version``
    is accepted for the signature's sake (the plan is the same in every version zerotrain
    follows).

    Raises:
        ElasticityConfigError: no enabled ``elasticity`` section, or an invalid one.
        ElasticityError / ElasticityIncompatibleWorldSize: as :func:`plan_elastic_batch`.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config must be a dict, got {type(ds_config).__name__}")
    if not elasticity_enabled(ds_config):
        raise ElasticityConfigError(
            "the config has no enabled 'elasticity' section (set elasticity.enabled true)"
        )
    try:
        section = load_config({"elasticity": ds_config["elasticity"]}).elasticity
    except ConfigError as err:
        raise ElasticityConfigError(str(err)) from err
    assert section is not None
    if world_size <= 0 and section.version == 0.2 and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])  # as DeepSpeed: version 0.2 needs one
    plan = plan_elastic_batch(section.options(), world_size)
    if world_size > 0 or return_microbatch:
        return plan.train_batch_size, list(plan.valid_world_sizes), plan.micro_batch_size
    return plan.train_batch_size, list(plan.valid_world_sizes)

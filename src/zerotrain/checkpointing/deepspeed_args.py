"""What DeepSpeed's ``checkpointing.configure(mpu_, deepspeed_config, ...)`` receives,
turned into zerotrain's terms: a settings policy from a config, a communicator from an mpu."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zerotrain.comm.collectives import Communicator
from zerotrain.config.loader import load_config
from zerotrain.config.policies import ActivationCheckpointingPolicy, activation_checkpointing_policy
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def policy_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any],
) -> ActivationCheckpointingPolicy:
    """The ``activation_checkpointing`` section of a whole config (dict or JSON path),
    validated as ``initialize`` validates it; the defaults when the section is absent."""
    cfg = load_config(dict(config) if isinstance(config, Mapping) else config)
    policy = activation_checkpointing_policy(cfg) or ActivationCheckpointingPolicy()
    if policy.block_types is not None:
        # Wrapping blocks needs the model, which only initialize() has.
        log.info(
            "checkpointing.configure: activation_checkpointing.block_types is applied by "
            "initialize(), not here; checkpoint() calls in the model use these settings"
        )
    return policy


def partition_group_of(mpu: Any) -> Communicator | None:
    """The tensor group of Megatron's model-parallel unit, as DeepSpeed reads it (its
    ``get_tensor_model_parallel_group``, else ``get_model_parallel_group``); None when the
    group has one rank (nothing to split over).

    Raises:
        TypeError: ``mpu`` has neither getter.
    """
    getter = getattr(mpu, "get_tensor_model_parallel_group", None) or getattr(
        mpu, "get_model_parallel_group", None
    )
    if getter is None:
        raise TypeError(
            "checkpointing.configure(mpu_=...): the mpu must have get_tensor_model_parallel_"
            "group() or get_model_parallel_group() (Megatron's mpu), or be None; got "
            f"{type(mpu).__name__}"
        )
    group = getter()
    comm = group if isinstance(group, Communicator) else Communicator(group)
    return comm if comm.world_size > 1 else None

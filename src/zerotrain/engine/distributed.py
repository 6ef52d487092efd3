"""``zerotrain.init_distributed``: DeepSpeed's ``deepspeed.init_distributed`` signature.

The process-group work is ``comm.env.init_distributed``; this layer adds DeepSpeed's
``config`` argument, which the comm layer cannot read (it knows nothing of configs).
"""

from __future__ import annotations

import datetime
from typing import Any

from zerotrain.comm.env import DEFAULT_PORT, DistEnv
from zerotrain.comm.env import init_distributed as _init_process_group
from zerotrain.config.loader import load_config
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> DistEnv:
    """Join (or create) the job's process group; returns where this rank sits.

    Arguments as DeepSpeed's (see ``zerotrain.comm.env.init_distributed``). ``config`` (a
    path, dict or loaded config) is validated here; DeepSpeed used it to set up its comms
    logger, which zerotrain configures from the same section at ``initialize`` for the
    engine's communicators. Differences: without any launcher variables a one-process
    group is created (DeepSpeed fails); the default timeout is ``ZEROTRAIN_COMM_TIMEOUT`` or
    600 s (DeepSpeed: 30 min); backends are ``gloo`` and ``nccl``.
    """
    if config is not None:
        cfg = load_config(config)
        if cfg.comms_logger.enabled:
            log.info(
                "init_distributed(config=...): comms_logger is applied by initialize() to "
                "the engine's communicators"
            )
    return _init_process_group(
        dist_backend=dist_backend,
        auto_mpi_discovery=auto_mpi_discovery,
        distributed_port=distributed_port,
        verbose=verbose,
        timeout=timeout,
        init_method=init_method,
        dist_init_required=dist_init_required,
        rank=rank,
        world_size=world_size,
    )

"""DeepSpeed's ``zero.Init`` arguments, checked against what zerotrain's Init can mean.

zerotrain's Init only records how parameters are initialised; ``initialize`` partitions
them over the ZeRO group its config builds, places the shards by
``zero_optimization.offload_param`` and casts them to the compute dtype. So an argument that
restates the config is accepted, one that would contradict it (or choose groups, quantised
weights or a swapper Init does not build) is refused, naming what to change instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from zerotrain.config.loader import load_config
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_GROUPS = ("data_parallel_group", "zero_param_parallel_group", "sequence_data_parallel_group")


def load_init_config(
    config_dict_or_path: str | os.PathLike[str] | Mapping[str, Any] | None, config: Any
) -> ZeroTrainConfig | None:
    """The config given to Init (``config`` is DeepSpeed's older name), validated."""
    if config is not None and config_dict_or_path is not None:
        raise ValueError("zero.Init: pass config_dict_or_path or config (its old name), not both")
    source = config_dict_or_path if config_dict_or_path is not None else config
    if source is None:
        return None
    return load_config(dict(source) if isinstance(source, Mapping) else source)


def _compute_dtype(cfg: ZeroTrainConfig | None) -> torch.dtype:
    if cfg is not None and cfg.fp16.enabled:
        return torch.float16
    if cfg is not None and cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def check_init_arguments(cfg: ZeroTrainConfig | None, **arguments: Any) -> None:
    """Refuse the DeepSpeed ``zero.Init`` arguments zerotrain cannot honour.

    Raises:
        ValueError: a process group, quantised weights, a parameter swapper, a ``dtype``
            other than fp32 or the config's compute dtype, or a ``remote_device`` that
            contradicts the config's ``offload_param.device``.
    """
    for name in _GROUPS:
        if arguments.get(name) is not None:
            raise ValueError(
                f"zero.Init({name}=...): zerotrain partitions over the ZeRO group initialize() "
                "builds from the config's parallel degrees (or its topology= argument); "
                "remove the argument"
            )
    for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if arguments.get(name):
            raise ValueError(f"zero.Init({name}=True): quantised weights are not supported")
    if arguments.get("param_swapper") is not None:
        raise ValueError(
            "zero.Init(param_swapper=...): parameter shards are swapped by zerotrain's own "
            "offload (zero_optimization.offload_param.device 'nvme'); remove the argument"
        )
    dtype = arguments.get("dtype")
    if dtype is not None and dtype not in (torch.float32, _compute_dtype(cfg)):
        raise ValueError(
            f"zero.Init(dtype={dtype}): parameters are kept in fp32 or in the config's compute "
            f"dtype ({_compute_dtype(cfg)}; pass config_dict_or_path with bf16/fp16 enabled), "
            "to which initialize() casts them"
        )
    _check_remote_device(cfg, arguments.get("remote_device"))
    if arguments.get("mpu") is not None or arguments.get("module") is not None:
        log.info(
            "zero.Init: mpu= and module= need nothing here; initialize() partitions every "
            "parameter of the model it is given over its ZeRO group"
        )


def _check_remote_device(cfg: ZeroTrainConfig | None, remote_device: Any) -> None:
    if remote_device is None or cfg is None:
        return  # placement is initialize()'s config's offload_param
    device = str(remote_device)
    configured = cfg.zero_optimization.offload_param.device
    host = ("cpu", "nvme")
    if (device in host or configured in host) and device != configured:
        raise ValueError(
            f"zero.Init(remote_device={device!r}) contradicts the config's "
            f"zero_optimization.offload_param.device {configured!r}: initialize() places the "
            "shards as the config says; set offload_param there instead"
        )

"""DeepSpeed's ``deepspeed.runtime.zero`` import path (``partition_parameters``,
``offload_config``), for
``import zerotrain as deepspeed``. The implementations live in ``zerotrain.zero``."""

from zerotrain.runtime.zero import offload_config, partition_parameters
from zerotrain.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "offload_config",
    "partition_parameters",
]

"""DeepSpeed's ``deepspeed.runtime.zero`` import path (``partition_parameters``), for
``import zerotrain as deepspeed``. The implementations live in ``zerotrain.zero``."""

from zerotrain.runtime.zero import partition_parameters
from zerotrain.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters"]

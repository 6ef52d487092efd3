"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` import path: ``Init``,
``GatheredParameters`` and ``ZeroParamStatus`` (what export scripts compare ``ds_status``
with). The implementations live in ``zerotrain.zero`` and ``zerotrain.shard.param_status``."""

from zerotrain.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

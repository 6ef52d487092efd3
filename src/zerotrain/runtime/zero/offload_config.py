"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` import path: the enums
``engine.offload_states()`` takes. The implementation lives in ``zerotrain.offload.states``."""

from zerotrain.offload.states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]

"""``deepspeed.ops.adam``: DeepSpeed's Adam classes, as names for zerotrain's Adam."""

from zerotrain.ops.adam.cpu_adam import DeepSpeedCPUAdam
from zerotrain.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

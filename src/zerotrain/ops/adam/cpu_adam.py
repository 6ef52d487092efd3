"""``deepspeed.ops.adam.cpu_adam``; the class lives in ``zerotrain.optim.deepspeed_ops``."""

from zerotrain.optim.deepspeed_ops import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]

"""``deepspeed.ops.adam.fused_adam``; the class lives in ``zerotrain.optim.deepspeed_ops``."""

from zerotrain.optim.deepspeed_ops import FusedAdam

__all__ = ["FusedAdam"]

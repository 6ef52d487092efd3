"""``deepspeed.ops.lamb.fused_lamb``; the class lives in ``zerotrain.optim.deepspeed_ops``."""

from zerotrain.optim.deepspeed_ops import FusedLamb

__all__ = ["FusedLamb"]

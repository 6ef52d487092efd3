"""``deepspeed.ops.lamb``: DeepSpeed's LAMB class, as a name for zerotrain's LAMB."""

from zerotrain.ops.lamb.fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

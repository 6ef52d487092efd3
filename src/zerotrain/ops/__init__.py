"""DeepSpeed's ``deepspeed.ops`` import paths for its optimizer classes, for
``import zerotrain as deepspeed``: ``ops.adam.DeepSpeedCPUAdam``, ``ops.adam.FusedAdam`` and
``ops.lamb.FusedLamb``. They are names for zerotrain's Adam and LAMB
(``zerotrain.optim.deepspeed_ops``); there are no separate kernels to build."""

from zerotrain.ops import adam, lamb

__all__ = ["adam", "lamb"]

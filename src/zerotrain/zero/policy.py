"""The ZeRO stage as data (``ZeroPolicy``). It is defined in ``shard/policy.py``, below the
units that read it; this module keeps the name where the strategy's readers look for it."""

from zerotrain.shard.policy import ZeroPolicy

__all__ = ["ZeroPolicy"]

"""ZeRO partitioning; the public stage-3 tools are ``Init`` and ``GatheredParameters``."""

from zerotrain.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]

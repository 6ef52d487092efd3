"""ZeRO partitioning; the public stage-3 tools are ``Init`` and ``GatheredParameters``."""

from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import Init

__all__ = ["GatheredParameters", "Init"]

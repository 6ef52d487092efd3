"""ZeRO partitioning; the public stage-3 tools are ``Init`` and ``GatheredParameters``
(``ZeroParamStatus``: the values of a stage-3 parameter's ``ds_status``)."""

from zerotrain.shard.param_status import ZeroParamStatus
from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]

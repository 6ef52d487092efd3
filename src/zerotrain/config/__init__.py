"""Typed configuration with DeepSpeed's key names.

``load_config`` turns a dict, a JSON file or ``--config PATH`` into a validated
:class:`ZeroTrainConfig`; ``to_policies`` resolves it against the world size into the
frozen policies the other layers receive.
"""

from zerotrain.config.batch import BatchSizes, resolve_batch_sizes
from zerotrain.config.errors import ConfigError, ConfigProblem
from zerotrain.config.loader import load_config
from zerotrain.config.policies import Policies, to_policies
from zerotrain.config.schema import ZeroTrainConfig

__all__ = [
    "BatchSizes",
    "ConfigError",
    "ConfigProblem",
    "Policies",
    "ZeroTrainConfig",
    "load_config",
    "resolve_batch_sizes",
    "to_policies",
]

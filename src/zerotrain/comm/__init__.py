"""Communication layer: process-group set-up, counted collectives, bucketing.

``collectives.py`` is the only module in zerotrain that calls torch.distributed collectives.
"""

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import CollectiveError, Communicator, Handle
from zerotrain.comm.env import DistEnv, init_distributed
from zerotrain.comm.stats import CollectiveCount, CommSnapshot, CommStats

__all__ = [
    "CollectiveCount",
    "CollectiveError",
    "CommSnapshot",
    "CommStats",
    "Communicator",
    "DistEnv",
    "Handle",
    "init_distributed",
    "plan_buckets",
]

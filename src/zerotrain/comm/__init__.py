"""Communication layer: process-group set-up, counted collectives, bucketing.

``collectives.py`` (and ``p2p.py`` for point-to-point) are the only modules in zerotrain
that call torch.distributed collectives.
"""

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import CollectiveError, Communicator, Handle
from zerotrain.comm.env import DistEnv, init_distributed
from zerotrain.comm.p2p import P2POp
from zerotrain.comm.stats import CollectiveCount, CommSnapshot, CommStats

__all__ = [
    "CollectiveCount",
    "CollectiveError",
    "CommSnapshot",
    "CommStats",
    "Communicator",
    "DistEnv",
    "Handle",
    "P2POp",
    "init_distributed",
    "plan_buckets",
]

"""Communication layer: process-group set-up, counted collectives, bucketing.

``collectives.py`` (and ``p2p.py`` for point-to-point) are the only modules in zerotrain
that call torch.distributed collectives for zerotrain itself. ``public.py`` is the
``deepspeed.comm``-style face for scripts (``import zerotrain.comm as dist``:
``get_rank``, ``all_reduce``, ``barrier``, ...), built on the same counted collectives.
"""

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import CollectiveError, Communicator, Handle
from zerotrain.comm.env import DistEnv, init_distributed
from zerotrain.comm.p2p import P2POp
from zerotrain.comm.public import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    configure,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    irecv,
    is_available,
    is_initialized,
    isend,
    log_summary,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    send,
)
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
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "configure",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "plan_buckets",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
]

"""``zerotrain.comm`` as ``deepspeed.comm``: torch.distributed's functions for scripts
(``import zerotrain.comm as dist``), on zerotrain's counted collectives.

Each process group (None: the whole job) gets one :class:`Communicator`, made on first use
(collective over that group: its ranks call the same function, as they must anyway). So a
script's collectives are counted in the group's ``CommStats``, timed by the comms logger
when ``configure`` (or an engine's ``comms_logger`` config) enables it, listed by
``log_summary``, and over gloo checked for matching signatures across ranks (a rank in a
different collective fails with a message instead of hanging). Reductions zerotrain has no
counted form of (``PRODUCT`` and the bitwise ops) go to torch.distributed directly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.comm.comms_logger import CommsLoggerPolicy
from zerotrain.comm.env import default_timeout
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_PURPOSE = "user"  # how a script's own collectives are labelled in counts and the logger
_COMMS: dict[int, tuple[Any, Communicator]] = {}  # id(group) -> (group, its communicator)
_policy = CommsLoggerPolicy()

_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}


def _communicator(group: Any = None) -> Communicator:
    if not dist.is_initialized():
        raise RuntimeError(
            "zerotrain.comm: no process group yet; call zerotrain.init_distributed() (or "
            "zerotrain.initialize) first"
        )
    key = id(group)
    found = _COMMS.get(key)
    if found is None or found[0] is not group:
        comm = Communicator(group=group, timeout=default_timeout())
        comm.configure_logger(_policy)
        _COMMS[key] = (group, comm)
        return comm
    return found[1]


def _done(handle: Handle, async_op: bool) -> Handle | None:
    return handle if async_op else None


# -- the job --------------------------------------------------------------------------------


def is_initialized() -> bool:
    """Whether the process group exists."""
    return dist.is_initialized()


def is_available() -> bool:
    """Whether torch.distributed is built in."""
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the job's without one); -1 before the process
    group exists, as torch.distributed says."""
    return dist.get_rank(group) if dist.is_initialized() else -1


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the job's without one)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, which every launcher sets)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any, group_rank: int) -> int:
    """The job-wide rank of ``group``'s rank ``group_rank``."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> Any:
    """The job's process group."""
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    """``gloo`` or ``nccl``."""
    return str(dist.get_backend(group))


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    """A process group of ``ranks`` (collective over the whole job, as in torch)."""
    return dist.new_group(ranks=list(ranks) if ranks is not None else None, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    """Tear down ``group`` (the job's without one), and this module's communicators of it."""
    for key, (known, _) in list(_COMMS.items()):
        if group is None or known is group:
            del _COMMS[key]
    dist.destroy_process_group(group)


# -- collectives ----------------------------------------------------------------------------


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> None:
    """Wait for every rank of ``group``; over gloo, ranks that never arrive are named."""
    del async_op, device_ids  # the wait is always complete on return
    _communicator(group).barrier()


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Handle | None:
    """Reduce ``tensor`` in place across ``group``."""
    comm = _communicator(group)
    if op == ReduceOp.AVG:
        if async_op:
            raise NotImplementedError(
                "all_reduce(op=ReduceOp.AVG, async_op=True): use SUM and divide by "
                "get_world_size() after wait()"
            )
        comm.all_reduce(tensor, purpose=_PURPOSE, op="sum")
        tensor.div_(comm.world_size)
        return None
    name = _OPS.get(op)
    if name is None:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return work if async_op else None
    return _done(comm.all_reduce(tensor, purpose=_PURPOSE, op=name, async_op=async_op), async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> Handle | None:
    """Copy rank ``src``'s ``tensor`` (a job-wide rank, as in torch) to every rank."""
    comm = _communicator(group)
    group_src = dist.get_group_rank(group, src) if group is not None else src
    return _done(
        comm.broadcast(tensor, src=group_src, purpose=_PURPOSE, async_op=async_op), async_op
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Handle | None:
    """Every rank's ``input_tensor`` concatenated along dim 0 into ``output_tensor``."""
    comm = _communicator(group)
    handle = comm.all_gather_into(
        output_tensor.view(-1), input_tensor.reshape(-1), purpose=_PURPOSE, async_op=async_op
    )
    return _done(handle, async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Handle | None:
    """Every rank's ``tensor`` into ``tensor_list`` (one per rank, rank order)."""
    if async_op:
        raise NotImplementedError("all_gather(async_op=True): use all_gather_into_tensor")
    comm = _communicator(group)
    flat = torch.empty((comm.world_size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather_into(flat.view(-1), tensor.reshape(-1), purpose=_PURPOSE)
    for out, row in zip(tensor_list, flat, strict=True):
        out.copy_(row.view_as(out))
    return None


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Handle | None:
    """Sum ``input`` across ranks; rank r gets chunk r (dim 0) into ``output``."""
    if op != ReduceOp.SUM:
        raise NotImplementedError(f"reduce_scatter_tensor with op={op}: only SUM is supported")
    comm = _communicator(group)
    handle = comm.reduce_scatter(
        output.view(-1), input.reshape(-1).clone(), purpose=_PURPOSE, async_op=async_op
    )
    return _done(handle, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Handle | None:
    """Sum ``input_list[r]`` across ranks into rank r's ``output``."""
    if async_op:
        raise NotImplementedError("reduce_scatter(async_op=True): use reduce_scatter_tensor")
    full = torch.cat([t.reshape(-1) for t in input_list])
    return reduce_scatter_tensor(output, full, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None) -> None:
    """Reduce into rank ``dst``'s ``tensor`` (the others' are left as all-reduced: the
    counted path reduces everywhere, which torch allows, since their result is unspecified)."""
    del dst
    all_reduce(tensor, op=op, group=group)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Handle | None:
    """Rows of ``input`` to every rank, theirs into ``output`` (dim 0)."""
    comm = _communicator(group)
    handle = comm.all_to_all(
        output,
        input,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        purpose=_PURPOSE,
        async_op=async_op,
    )
    return _done(handle, async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to job-wide rank ``dst`` (blocking)."""
    del tag
    comm = _communicator(group)
    peer = dist.get_group_rank(group, dst) if group is not None else dst
    comm.send(tensor.contiguous(), peer, purpose=_PURPOSE)


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from job-wide rank ``src`` (blocking); returns ``src``."""
    del tag
    comm = _communicator(group)
    peer = dist.get_group_rank(group, src) if group is not None else src
    comm.recv(tensor, peer, purpose=_PURPOSE)
    return src


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Handle:
    """Send without waiting; ``wait()`` the handle."""
    del tag
    comm = _communicator(group)
    peer = dist.get_group_rank(group, dst) if group is not None else dst
    return comm.send(tensor.contiguous(), peer, purpose=_PURPOSE, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Handle:
    """Receive without waiting; ``wait()`` the handle."""
    del tag
    comm = _communicator(group)
    peer = dist.get_group_rank(group, src) if group is not None else src
    return comm.recv(tensor, peer, purpose=_PURPOSE, async_op=True)


# -- the comms logger -----------------------------------------------------------------------


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: Sequence[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Set the comms logger for this module's collectives (DeepSpeed's
    ``deepspeed.comm.configure``): from a config's ``comms_logger`` section (a dict or
    an object with ``comms_config``), then the keyword arguments given."""
    keys: dict[str, Any] = {}
    if deepspeed_config is not None:
        section = (
            deepspeed_config.get("comms_logger", {})
            if isinstance(deepspeed_config, dict)
            else getattr(deepspeed_config, "comms_config", {})
        )
        keys.update(section if isinstance(section, dict) else vars(section))
    given = {"enabled": enabled, "prof_all": prof_all, "verbose": verbose, "debug": debug}
    keys.update({k: v for k, v in given.items() if v is not None})
    if prof_ops is not None:
        keys["prof_ops"] = tuple(prof_ops)
    known = {"enabled", "prof_all", "prof_ops", "verbose", "debug"}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"comms_logger: unknown key(s) {unknown}; allowed: {sorted(known)}")
    if "prof_ops" in keys:
        keys["prof_ops"] = tuple(keys["prof_ops"])
    use_logger_policy(CommsLoggerPolicy(**keys))


def use_logger_policy(policy: CommsLoggerPolicy) -> None:
    """What an engine's ``comms_logger`` config sets for scripts' collectives too."""
    global _policy
    _policy = policy
    for _, comm in _COMMS.values():
        comm.configure_logger(policy)


def forget_communicators() -> None:
    """Drop this module's communicators and comms-logger settings, as a new process starts
    with none (a test pool between tests; destroying groups is the caller's business)."""
    global _policy
    _COMMS.clear()
    _policy = CommsLoggerPolicy()


def log_summary(show_straggler: bool = False) -> str:
    """The comms logger's table of this module's collectives so far (logged on rank 0;
    also returned). ``show_straggler`` is accepted; zerotrain does not measure it."""
    del show_straggler
    parts = [comm.comms_summary().table() for _, comm in _COMMS.values()]
    text = "\n".join(parts) if parts else "no collectives through zerotrain.comm yet"
    if get_rank() <= 0:
        log.info("zerotrain.comm collectives:\n%s", text)
    return text


__all__ = [
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
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
]

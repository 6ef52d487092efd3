"""Checks that the ranks entered the same collective, run over gloo before it.

Ranks in mismatched gloo collectives either abort inside gloo (a C++ exception on its
thread) or exchange the wrong data; these small collectives turn that into a clear
:class:`CollectiveError` on every rank. ``ZEROTRAIN_VERIFY_COLLECTIVES=0`` turns them off.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zerotrain.comm import liveness
from zerotrain.comm.handle import CollectiveError, failure_message
from zerotrain.comm.splits import split_mismatches


def _wait(work: dist.Work, timeout: datetime.timedelta | None) -> None:
    with liveness.waiting():
        work.wait(timeout) if timeout is not None else work.wait()


def verify_signature(
    group: dist.ProcessGroup | None,
    rank: int,
    timeout: datetime.timedelta | None,
    signature: str,
    explain: Callable[[], str] | None = None,
) -> None:
    """All-reduce a CRC of ``signature`` (16 bytes: the max of the code and of its
    negation); raise on every rank if any rank's differs. ``explain``: names the ranks that
    stopped answering, when the check itself fails."""
    code = float(zlib.crc32(signature.encode()))
    both = torch.tensor([code, -code], dtype=torch.float64)
    try:
        _wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout)
    except Exception as exc:
        raise CollectiveError(
            failure_message(f"rank {rank}: {signature} (signature check)", exc, explain=explain)
        ) from exc
    if both[0].item() != -both[1].item():
        raise CollectiveError(
            f"rank {rank}: the ranks entered different collectives (they took "
            f"different code paths, e.g. a module run on one rank and not another): "
            f"this rank is in {signature}, another rank in a different one"
        )


def verify_splits(
    group: dist.ProcessGroup | None,
    rank: int,
    timeout: datetime.timedelta | None,
    splits: tuple[Sequence[int], Sequence[int]],
    signature: str,
    explain: Callable[[], str] | None = None,
) -> None:
    """Gather every rank's all-to-all ``(input, output)`` splits; raise on every rank,
    naming each pair that disagrees. Safe only after :func:`verify_signature` passed (the
    gathered size depends on the group only)."""
    sends, recvs = list(splits[0]), list(splits[1])
    n = len(sends)
    mine = torch.tensor(sends + recvs, dtype=torch.int64)
    table = torch.empty(n * 2 * n, dtype=torch.int64)
    what = f"rank {rank}: {signature} (split check)"
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        _wait(gather(table, mine, group=group, async_op=True), timeout)
    except Exception as exc:
        raise CollectiveError(failure_message(what, exc, explain=explain)) from exc
    rows = table.view(n, 2 * n)
    problems = split_mismatches(rows[:, :n].tolist(), rows[:, n:].tolist())
    if problems:
        raise CollectiveError(f"{what}: the split sizes disagree: " + "; ".join(problems))

"""Counters of collective calls and bytes, fed only by ``collectives.py`` and ``p2p.py``.

Volumes follow the ZeRO paper's model so stages can be compared with its 2Ψ / 3Ψ analysis:
an all-reduce of S bytes moves 2S (a reduce-scatter plus an all-gather), a reduce-scatter or
an all-gather of a full tensor of S bytes moves S, a broadcast of S bytes moves S. The model
does not depend on the world size. Beyond the paper: an all-to-all counts the bytes of this
rank's input (what it sends, its own rows included), a point-to-point ``send`` or ``recv``
the bytes of its tensor, on the rank that issued it. ``payload_bytes`` is the plain size of
the full tensor.
Latency and bandwidth (nccl-tests' algbw / busbw, which do depend on the world size) are the
comms logger's, in ``comms_logger.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

VOLUME_FACTOR: Mapping[str, int] = MappingProxyType(
    {
        "all_reduce": 2,
        "reduce_scatter": 1,
        "all_gather": 1,
        "broadcast": 1,
        "all_to_all": 1,
        "send": 1,
        "recv": 1,
    }
)


@dataclass(frozen=True, slots=True)
class CollectiveCount:
    """Calls made and bytes moved by one kind of collective (or a sum of kinds)."""

    calls: int = 0
    bytes: int = 0
    payload_bytes: int = 0

    def __add__(self, other: CollectiveCount) -> CollectiveCount:
        return CollectiveCount(
            self.calls + other.calls,
            self.bytes + other.bytes,
            self.payload_bytes + other.payload_bytes,
        )


@dataclass(frozen=True, slots=True)
class CommSnapshot:
    """Immutable view of the counters, keyed by ``(op, purpose)``.

    ``purpose`` says why the collective ran: ``"gradients"``, ``"parameters"``, ``"init"``
    (state broadcast at start-up) or ``"control"`` (loss averages for logging, flags).
    """

    counts: Mapping[tuple[str, str], CollectiveCount]

    def get(self, op: str | None = None, purpose: str | None = None) -> CollectiveCount:
        """Sum over every entry matching ``op`` and ``purpose`` (None matches all)."""
        total = CollectiveCount()
        for (o, p), count in self.counts.items():
            if (op is None or o == op) and (purpose is None or p == purpose):
                total = total + count
        return total

    @property
    def total(self) -> CollectiveCount:
        """Everything recorded."""
        return self.get()

    def __str__(self) -> str:
        rows = [f"{'op':<15}{'purpose':<12}{'calls':>8}{'bytes':>16}"]
        for (op, purpose), c in sorted(self.counts.items()):
            rows.append(f"{op:<15}{purpose:<12}{c.calls:>8}{c.bytes:>16}")
        return "\n".join(rows)


class CommStats:
    """Mutable counters owned by one ``Communicator``."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], CollectiveCount] = {}

    def record(self, op: str, purpose: str, payload_bytes: int) -> None:
        """Count one call of ``op`` on a full tensor of ``payload_bytes``."""
        volume = VOLUME_FACTOR[op] * payload_bytes
        key = (op, purpose)
        self._counts[key] = self._counts.get(key, CollectiveCount()) + CollectiveCount(
            1, volume, payload_bytes
        )

    def snapshot(self) -> CommSnapshot:
        """A frozen copy of the counters."""
        return CommSnapshot(MappingProxyType(dict(self._counts)))

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._counts.clear()

"""The comms logger: latency and bandwidth of each collective, fed by collectives and p2p.

``CommStats`` counts every collective (calls and bytes in the ZeRO paper's volume model);
this module adds *time*, when a :class:`CommsLoggerPolicy` enables it (DeepSpeed's
``comms_logger`` section). A profiled collective is timed from the moment it is issued
(after the signature check, which also lines the ranks up) until it is known to be complete:

* a blocking call, or one that completed inside the issuing call (the shared-memory path runs
  synchronously): the time of the call itself;
* an asynchronous call still in flight when it was issued: until its ``Handle.wait()``
  returned. That includes whatever the caller overlapped with it before waiting, so its
  bandwidth is a lower bound; such samples are kept apart (``overlapped=True``).

On CUDA the device is synchronised before the clock starts and after the collective, so
queued kernels are not charged to it and the kernel is really done; a profiled collective
therefore no longer overlaps with compute. Nothing is timed or synchronised for a collective
that is not profiled: ``CommsLogger.start`` returns None and the caller skips everything.

Bandwidth follows nccl-tests: ``algbw = payload bytes / latency`` and ``busbw = algbw x f``
with ``f = 2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter, and 1
for broadcast (``n`` ranks; payload = the full tensor); all-to-all is ``(n-1)/n`` of this
rank's input, and a point-to-point batch is one sample (op ``send``, ``recv``, or
``send_recv`` when it does both) whose payload is the larger of the bytes sent and received,
factor 1, as nccl-tests' sendrecv counts one direction. Sums over several samples divide
total bytes by total time, so large messages weigh more than small ones.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import torch

from zerotrain.utils.device import synchronize
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import format_bytes

log = get_logger(__name__)

#: The collectives a ``Communicator`` issues (the names ``CommStats`` records).
OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send",
    "recv",
    "send_recv",
)

# DeepSpeed's (and torch.distributed's) spellings of the same operations, so a DeepSpeed
# config's ``prof_ops`` works unchanged where the mapping is obvious.
OP_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "allreduce": "all_reduce",
        "inference_all_reduce": "all_reduce",
        "allgather": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "all_gather_base": "all_gather",
        "_all_gather_base": "all_gather",
        "all_gather_single": "all_gather",
        "all_gather_into": "all_gather",
        "reducescatter": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "reduce_scatter_base": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_fn": "reduce_scatter",
        "all_to_all_single": "all_to_all",
        "alltoall": "all_to_all",
        "isend": "send",
        "irecv": "recv",
        "batch_isend_irecv": "send_recv",
        "exchange": "send_recv",
    }
)


def canonical_op(name: str) -> str:
    """The collective ``name`` stands for (``"all_gather_into_tensor"`` -> ``"all_gather"``).

    Raises:
        ValueError: ``name`` is neither a collective nor an alias of one.
    """
    key = name.strip().lower()
    if key in OPS:
        return key
    if key in OP_ALIASES:
        return OP_ALIASES[key]
    allowed = ", ".join([*OPS, *sorted(OP_ALIASES)])
    raise ValueError(f"comms_logger.prof_ops: unknown collective {name!r}; allowed: {allowed}")


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' ``busbw / algbw`` for ``op`` on ``world_size`` ranks."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send", "recv", "send_recv"):
        return 1.0
    if op == "all_to_all":
        return (n - 1) / n
    raise ValueError(f"no bus bandwidth factor for {op!r}; known: {', '.join(OPS)}")


@dataclass(frozen=True, slots=True)
class CommsLoggerPolicy:
    """What the comms logger measures (DeepSpeed's ``comms_logger`` keys).

    Args:
        enabled: time collectives at all; when False nothing is timed or synchronised.
        verbose: log every profiled collective as it completes (op, purpose, bytes,
            latency, algbw, busbw), at INFO through ``zerotrain.comm.comms_logger``.
        prof_all: profile every collective; when False only those named in ``prof_ops``.
        prof_ops: collectives to profile when ``prof_all`` is False: ``all_reduce``,
            ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``send``,
            ``recv``, ``send_recv`` (a point-to-point batch that does both) or an alias
            (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...). Stored canonical.
        debug: name the caller: the summary keeps a row per ``label`` (the unit a
            collective belongs to, e.g. ``"layers.3"``) and verbose lines show it.

    Raises:
        ValueError: a name in ``prof_ops`` is unknown (the message lists the allowed ones).
    """

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    debug: bool = False

    def __post_init__(self) -> None:
        # Canonical names once, here, so the per-collective check is a tuple lookup; a list
        # from a config is accepted and frozen into a tuple.
        ops = tuple(dict.fromkeys(canonical_op(name) for name in self.prof_ops))
        object.__setattr__(self, "prof_ops", ops)

    def profiles(self, op: str) -> bool:
        """Whether a collective ``op`` is timed under this policy."""
        return self.enabled and (self.prof_all or op in self.prof_ops)


class CommsKey(NamedTuple):
    """What a summary row is about.

    ``overlapped``: the collective was asynchronous and still running when issued, so its
    latency runs until ``Handle.wait()`` returned. ``label``: the caller, only with ``debug``.
    """

    op: str
    purpose: str
    payload_bytes: int
    overlapped: bool
    label: str | None


@dataclass(frozen=True, slots=True)
class OpTiming:
    """Latencies of a set of collectives (seconds) and the bytes they carried.

    ``payload_bytes`` is the sum of full-tensor sizes, ``bus_bytes`` the same weighted by each
    op's bus factor, so ``busbw / algbw`` of a single op kind is its factor.
    """

    calls: int = 0
    payload_bytes: int = 0
    bus_bytes: float = 0.0
    total_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0

    def __add__(self, other: OpTiming) -> OpTiming:
        return OpTiming(
            self.calls + other.calls,
            self.payload_bytes + other.payload_bytes,
            self.bus_bytes + other.bus_bytes,
            self.total_s + other.total_s,
            min(self.min_s, other.min_s),
            max(self.max_s, other.max_s),
        )

    @property
    def mean_s(self) -> float:
        """Mean latency in seconds (0 when nothing was recorded)."""
        return self.total_s / self.calls if self.calls else 0.0

    @property
    def algbw(self) -> float:
        """Algorithmic bandwidth, bytes per second: payload bytes / latency."""
        return self.payload_bytes / self.total_s if self.total_s > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth, bytes per second: algbw times the op's bus factor."""
        return self.bus_bytes / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class CommsSummary:
    """Immutable view of the comms logger's measurements, keyed by :class:`CommsKey`."""

    world_size: int
    entries: Mapping[CommsKey, OpTiming]

    def get(
        self,
        op: str | None = None,
        purpose: str | None = None,
        *,
        payload_bytes: int | None = None,
        overlapped: bool | None = None,
        label: str | None = None,
    ) -> OpTiming:
        """Sum over every entry matching all the given fields (None matches all)."""
        total = OpTiming()
        for key, timing in self.entries.items():
            if (
                (op is None or key.op == op)
                and (purpose is None or key.purpose == purpose)
                and (payload_bytes is None or key.payload_bytes == payload_bytes)
                and (overlapped is None or key.overlapped == overlapped)
                and (label is None or key.label == label)
            ):
                total = total + timing
        return total

    @property
    def total(self) -> OpTiming:
        """Everything recorded."""
        return self.get()

    def table(self, by_size: bool = True) -> str:
        """A text table: one row per op, purpose, mode (sync / overlapped async) and, with
        ``by_size``, message size (as DeepSpeed groups its summary); a caller column when
        ``debug`` recorded labels. Bandwidths in GB/s (1e9 bytes), sizes in MB (1e6)."""
        groups: dict[tuple[str, str, str, str, int], OpTiming] = {}
        for key, timing in self.entries.items():
            group = (
                key.op,
                key.purpose,
                key.label or "",
                "async" if key.overlapped else "sync",
                key.payload_bytes if by_size else -1,
            )
            groups[group] = groups.get(group, OpTiming()) + timing
        with_caller = any(group[2] for group in groups)
        head = f"{'op':<15}{'purpose':<12}" + (f"{'caller':<24}" if with_caller else "")
        head += f"{'mode':<7}" + (f"{'msg size':>11}" if by_size else "")
        head += (
            f"{'count':>8}{'total MB':>11}{'avg ms':>10}{'min ms':>10}{'max ms':>10}"
            f"{'algbw GB/s':>12}{'busbw GB/s':>12}"
        )
        rows = [head]
        for (op, purpose, caller, mode, size), t in sorted(groups.items()):
            row = f"{op:<15}{purpose:<12}" + (f"{caller:<24}" if with_caller else "")
            row += f"{mode:<7}" + (f"{format_bytes(size, decimals=2):>11}" if by_size else "")
            row += (
                f"{t.calls:>8}{t.payload_bytes / 1e6:>11.3f}{t.mean_s * 1e3:>10.3f}"
                f"{t.min_s * 1e3:>10.3f}{t.max_s * 1e3:>10.3f}"
                f"{t.algbw / 1e9:>12.3f}{t.busbw / 1e9:>12.3f}"
            )
            rows.append(row)
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


class OpTimer:
    """One profiled collective in flight; :meth:`stop` records it (once)."""

    __slots__ = ("_device", "_label", "_logger", "_nbytes", "_op", "_purpose", "_start")

    def __init__(
        self,
        logger: CommsLogger,
        op: str,
        purpose: str,
        nbytes: int,
        device: torch.device,
        label: str | None,
    ) -> None:
        self._logger = logger
        self._op = op
        self._purpose = purpose
        self._nbytes = nbytes
        self._device = device
        self._label = label
        synchronize(device)  # earlier queued kernels are not this collective's time
        self._start: float | None = time.perf_counter()

    def stop(self, overlapped: bool) -> None:
        """The collective is complete: record its latency (later calls do nothing)."""
        if self._start is None:
            return
        synchronize(self._device)  # NCCL's wait only orders streams; the host must wait too
        elapsed = time.perf_counter() - self._start
        self._start = None
        self._logger.record(self._op, self._purpose, self._nbytes, elapsed, overlapped, self._label)

    def stopping(self, on_done: Callable[[], None] | None, overlapped: bool) -> Callable[[], None]:
        """``on_done`` preceded by :meth:`stop`, for a ``Handle``: the clock stops when the
        wait returned, before the caller's completion work (copies out of staging buffers)."""

        def done() -> None:
            self.stop(overlapped)
            if on_done is not None:
                on_done()

        return done


class CommsLogger:
    """Latency records of one ``Communicator`` under a :class:`CommsLoggerPolicy`.

    Args:
        world_size: ranks in the communicator's group (for the bus bandwidth factor).
        policy: what to measure (default: nothing).
    """

    def __init__(self, world_size: int, policy: CommsLoggerPolicy | None = None) -> None:
        self.world_size = world_size
        self.policy = policy if policy is not None else CommsLoggerPolicy()
        self._entries: dict[CommsKey, OpTiming] = {}
        # Handles may be waited on from autograd's threads while the main thread issues.
        self._lock = threading.Lock()

    def start(
        self, op: str, purpose: str, nbytes: int, device: torch.device, label: str | None
    ) -> OpTimer | None:
        """Start timing a collective about to be issued, or None if it is not profiled
        (then nothing at all happens: no clock read, no device synchronisation)."""
        if not self.policy.profiles(op):
            return None
        return OpTimer(self, op, purpose, nbytes, device, label)

    def record(
        self,
        op: str,
        purpose: str,
        nbytes: int,
        seconds: float,
        overlapped: bool,
        label: str | None = None,
    ) -> None:
        """Add one completed collective of ``nbytes`` payload that took ``seconds``."""
        factor = bus_factor(op, self.world_size)
        key = CommsKey(op, purpose, nbytes, overlapped, label if self.policy.debug else None)
        sample = OpTiming(1, nbytes, nbytes * factor, seconds, seconds, seconds)
        with self._lock:
            self._entries[key] = self._entries.get(key, OpTiming()) + sample
        if self.policy.verbose:
            caller = f" [{label}]" if self.policy.debug and label else ""
            algbw = nbytes / seconds if seconds > 0 else 0.0
            log.info(
                "comm op: %s | purpose: %s%s | msg size: %s | latency: %.3f ms%s | "
                "algbw: %.3f GB/s | busbw: %.3f GB/s",
                op,
                purpose,
                caller,
                format_bytes(nbytes, decimals=2),
                seconds * 1e3,
                " (to wait)" if overlapped else "",
                algbw / 1e9,
                algbw * factor / 1e9,
            )

    def summary(self) -> CommsSummary:
        """A frozen copy of everything recorded."""
        with self._lock:
            return CommsSummary(self.world_size, MappingProxyType(dict(self._entries)))

    def reset(self) -> None:
        """Forget every measurement (the policy stays)."""
        with self._lock:
            self._entries.clear()

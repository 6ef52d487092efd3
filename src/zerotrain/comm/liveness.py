"""Whether peer ranks are still there: heartbeats, not process ids.

A process id says nothing about a rank in another PID namespace, and a zombie (exited, not
yet reaped) still has one. Instead every rank ticks a heartbeat twice a second from a
daemon thread of its own, in two places:

- each shared-memory arena it belongs to (a counter in its control line), read by ranks
  waiting in a barrier: a late peer whose counter has not moved for
  ``ZEROTRAIN_HEARTBEAT_TIMEOUT`` seconds (default 10) is reported as not answering (dead,
  stopped with SIGSTOP, or hung with the interpreter locked), long before the collective
  timeout;
- the job's rendezvous store (a counter per global rank), read when a gloo collective
  failed or timed out: the ranks whose counter stands still over a few seconds are named
  (gloo itself only says "connection closed by peer" or "timed out").

The thread takes the interpreter lock for microseconds every half second; a rank busy in
PyTorch kernels (which release the lock) keeps ticking, so only a rank that is gone or
stopped falls silent. Process ids still serve the messages (on the same PID namespace:
"exited", "zombie", "stopped").
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch.distributed as dist

from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

INTERVAL = 0.5  # seconds between ticks
_STORE_PREFIX = "zerotrain/heartbeat/"


def heartbeat_timeout() -> float:
    """Seconds without a tick after which a waiting peer counts as not answering
    (``ZEROTRAIN_HEARTBEAT_TIMEOUT``, default 10)."""
    raw = os.environ.get("ZEROTRAIN_HEARTBEAT_TIMEOUT")
    if not raw:
        return 10.0
    value = float(raw)
    if value < 2 * INTERVAL:
        raise ValueError(f"ZEROTRAIN_HEARTBEAT_TIMEOUT must be >= {2 * INTERVAL}, got {raw!r}")
    return value


def process_state(pid: int) -> str:
    """What ``/proc`` says about ``pid`` in this PID namespace, for messages: "exited",
    "a zombie (exited, not reaped)", "stopped (SIGSTOP)", or "running"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return {
        b"Z": "a zombie (exited, not reaped)",
        b"X": "exited",
        b"T": "stopped (SIGSTOP)",
        b"t": "stopped (traced)",
    }.get(state, "running")


def pid_namespace() -> int:
    """This process's PID namespace (its inode), 0 when unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_tag() -> str:
    """This process as names of what it leaves on disk or in /dev/shm carry it:
    ``PID.NAMESPACE`` (the PID namespace's inode: a process id means something only inside
    its namespace), so that leftovers of a killed process can be recognised later."""
    return f"{os.getpid()}.{pid_namespace()}"


def tag_owner(tag: str) -> int | None:
    """The process id in ``tag`` (a :func:`process_tag`) when it is from this PID
    namespace; None otherwise (another namespace's ids mean nothing here)."""
    pid, _, namespace = tag.partition(".")
    if not pid.isdigit() or namespace != str(pid_namespace()):
        return None
    return int(pid)


def tag_owner_gone(tag: str) -> bool:
    """Whether ``tag``'s process is known to be gone: from this namespace, no ``/proc``."""
    pid = tag_owner(tag)
    return pid is not None and not os.path.exists(f"/proc/{pid}")


class _Beater:
    """The process's heartbeat thread and what it ticks."""

    def __init__(self) -> None:
        self._ticks: weakref.WeakSet[Tickable] = weakref.WeakSet()
        self._store: tuple[dist.Store, str] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stop = threading.Event()

    def add(self, target: Tickable) -> None:
        with self._lock:
            self._ticks.add(target)
        self._start()

    def watch_store(self, store: dist.Store, rank: int) -> None:
        with self._lock:
            self._store = (store, f"{_STORE_PREFIX}{rank}")
        self._start()

    def _start(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's thread is not ours
            self.__init__()  # type: ignore[misc]
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="zerotrain-heartbeat", daemon=True
            )
            self._thread.start()
            # Stopped before the interpreter finalises: a daemon thread caught inside the
            # store's C++ client while static destructors run aborts the process
            # ("terminate called without an active exception").
            atexit.unregister(self.stop)
            atexit.register(self.stop)

    def stop(self) -> None:
        """End the thread (at exit; idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                targets = list(self._ticks)
                store = self._store
            for target in targets:
                target.tick()
            if store is not None:
                with contextlib.suppress(Exception):  # the store's host may be gone
                    store[0].add(store[1], 1)
            self._stop.wait(INTERVAL)


class Tickable:
    """Something the heartbeat thread ticks (``tick`` must be cheap and never block)."""

    def tick(self) -> None:
        raise NotImplementedError


_BEATER = _Beater()


def beat_for(target: Tickable) -> None:
    """Tick ``target`` from this process's heartbeat thread for as long as it lives."""
    _BEATER.add(target)


class StoreHeartbeats:
    """This job's heartbeats in the rendezvous store (one counter per global rank).

    Args:
        store: a client of the job's store (its own connection: used from two threads).
        rank: this rank's global rank.
    """

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store = store
        self.rank = rank
        self._lock = threading.Lock()
        _BEATER.watch_store(store, rank)

    def _counts(self, ranks: Sequence[int]) -> list[int] | None:
        try:
            with self._lock:
                return [int(self.store.add(f"{_STORE_PREFIX}{r}", 0)) for r in ranks]
        except Exception:
            return None

    def silent(self, ranks: Sequence[int], window: float) -> list[int] | None:
        """The ranks among ``ranks`` (global) whose heartbeat did not move in ``window``
        seconds; None when the store cannot be reached (its host is gone)."""
        others = [r for r in ranks if r != self.rank]
        before = self._counts(others)
        if before is None:
            return None
        deadline = time.monotonic() + window
        moving: set[int] = set()
        while time.monotonic() < deadline and len(moving) < len(others):
            time.sleep(INTERVAL)
            now = self._counts(others)
            if now is None:
                return None
            moving |= {r for r, a, b in zip(others, before, now, strict=True) if b != a}
        return [r for r in others if r not in moving]


_STORE: StoreHeartbeats | None = None


def start_store_heartbeats(
    rank: int, make_store: Callable[[], dist.Store | None]
) -> StoreHeartbeats | None:
    """Tick this rank's counter in the job's store from now on (once per process); None
    when no store can be reached (a one-process job)."""
    global _STORE
    if _STORE is None or _STORE.rank != rank:
        store = None
        with contextlib.suppress(Exception):
            store = make_store()
        _STORE = StoreHeartbeats(store, rank) if store is not None else None
    return _STORE


def explain_failure(ranks: Sequence[int], window: float | None = None) -> str:
    """After a collective over ``ranks`` (global) failed: which of them stopped answering,
    as a sentence ('' when nothing can be said)."""
    if _STORE is None:
        return ""
    # A live rank ticks every INTERVAL: five ticks missed is silence worth naming.
    window = window if window is not None else min(heartbeat_timeout(), 5 * INTERVAL)
    silent = _STORE.silent(ranks, window)
    if silent is None:
        return (
            " The job's rendezvous store cannot be reached: the host running it (global rank "
            "0's, or the launcher's) is probably gone."
        )
    if not silent:
        return ""
    return (
        f" Rank(s) {silent} stopped answering (no heartbeat for {window:.0f} s): they died, "
        "were stopped (SIGSTOP) or hang with the interpreter locked."
    )


def store_client(timeout: datetime.timedelta) -> dist.Store | None:
    """A new client connection to the job's store from ``MASTER_ADDR``/``MASTER_PORT``
    (None without them)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)

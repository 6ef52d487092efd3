"""Who each rank is and how it left: identity records and exit markers in the job's store.

When a collective fails over TCP or NCCL, the transport's error names no rank ("Connection
closed by peer", "NCCL error"). Heartbeats (``liveness.py``) tell a silent rank within a few
seconds; this module makes the answer immediate and specific where it can:

- **identity**: when its heartbeats start, each rank records its host, the machine's boot
  id, its process id and PID namespace (``zerotrain/whois/<rank>``), so that messages name
  the host to look at, and a peer on the same machine and PID namespace can ask ``/proc``
  whether the process exited, is a zombie or is stopped;
- **exit marker** (``zerotrain/exited/<rank>``): written when the rank ends: at interpreter
  exit (with the uncaught exception that ended it, if one did), when the peer watchdog
  gives up, and on SIGTERM or SIGHUP where their disposition was the default (a scheduler
  cancelling the job, torchrun stopping the survivors). SIGKILL leaves no marker: there the
  heartbeat or ``/proc`` decides.

The signal marker is written even while the main thread is blocked inside a collective
(where a Python signal handler would not run until the collective returns): the signal
also wakes a small thread through ``signal.set_wakeup_fd``, which writes the marker and
lets the signal end the process as it would have.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch.distributed as dist


def _round() -> str:
    """This round of the job: torchrun's run id and restart count, so that a restarted
    round, which keeps the same store, never reads the last round's markers ("killed by
    SIGTERM" on every rank it restarted); one round where there is no torchrun."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"{run}.{restart}" if run or restart else "0"


_PREFIX = f"zerotrain/{_round()}/"
WHOIS_PREFIX = f"{_PREFIX}whois/"
EXIT_PREFIX = f"{_PREFIX}exited/"
ABANDON_PREFIX = f"{_PREFIX}abandoned/"
# How many exit markers and abandon notices were written: one cheap read tells whether to
# read them.
EXITS_COUNTER = f"{_PREFIX}exits"
# A write after a failure waits at most this long for the store (its host may be stopped).
_WRITE_S = 1.0
EXITED_CLEANLY = "exited"  # the marker of an interpreter exit without an uncaught exception
GAVE_UP = "gave up on its peers"  # the start of the marker of a rank the watchdog ended
_MARKED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_REASON_CHARS = 300  # an exception's text in a marker is cut to this


class StoreStalledError(RuntimeError):
    """A store request did not answer in time (its host is stopped or unreachable)."""


class Bounded:
    """Runs store requests on a helper thread with a deadline: a TCPStore client waits
    without limit for a store whose host is stopped (SIGSTOP) or cut off without a reset,
    whatever its timeout says (found: ``check`` on a stopped store never returned). One
    request at a time: while one is stuck, the next fails at once instead of adding
    another stuck thread."""

    def __init__(self) -> None:
        self._stuck: threading.Thread | None = None

    def __call__(self, request: Callable[[], Any], seconds: float) -> Any:
        """``request()``, or :class:`StoreStalledError` after ``seconds``; its own error
        when it raises."""
        if self._stuck is not None and self._stuck.is_alive():
            raise StoreStalledError("an earlier store request is still waiting")
        outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                outcome.append((True, request()))
            except BaseException as error:  # handed to the caller
                outcome.append((False, error))

        thread = threading.Thread(target=run, name="zerotrain-store-request", daemon=True)
        thread.start()
        thread.join(seconds)
        if not outcome:
            self._stuck = thread
            raise StoreStalledError(f"the store did not answer within {seconds:.0f} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def boot_id() -> str:
    """This machine's boot id (two processes with the same one share a kernel, so a
    process id can be looked up); the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclasses.dataclass(frozen=True)
class Whois:
    """Where a rank runs, as recorded in the job's store."""

    rank: int
    host: str
    boot: str
    pid: int
    namespace: int

    @staticmethod
    def of_this_process(rank: int) -> Whois:
        from zerotrain.comm.liveness import pid_namespace

        return Whois(rank, socket.gethostname(), boot_id(), os.getpid(), pid_namespace())

    def encode(self) -> str:
        return f"{self.host}\t{self.boot}\t{self.pid}\t{self.namespace}"

    @staticmethod
    def decode(rank: int, text: str) -> Whois:
        host, boot, pid, namespace = text.split("\t")
        return Whois(rank, host, boot, int(pid), int(namespace))

    def label(self) -> str:
        """``rank 1 (host node-a, pid 4242)``."""
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def process_state(self) -> str | None:
        """What ``/proc`` says of the rank's process (``liveness.process_state``), None
        where this process cannot see it (another machine or PID namespace)."""
        from zerotrain.comm.liveness import pid_namespace, process_state

        if self.boot != boot_id() or self.namespace != pid_namespace():
            return None
        return process_state(self.pid)


def label(rank: int, whois: dict[int, Whois]) -> str:
    """``rank 1 (host node-a, pid 4242)``, or ``rank 1 (host unknown)`` for a rank that
    never recorded itself (it ended before its heartbeats started)."""
    return whois[rank].label() if rank in whois else f"rank {rank} (host unknown)"


class StoreRecords:
    """This job's identity records and exit markers, through one store client shared with
    the heartbeat thread under ``lock`` (a client is not safe for concurrent use).

    Args:
        store: a client of the job's store.
        rank: this rank's global rank.
        lock: taken around every use of ``store``.
    """

    def __init__(self, store: dist.Store, rank: int, lock: threading.Lock) -> None:
        self.store = store
        self.rank = rank
        self._lock = lock
        self._pid = os.getpid()
        self._writes = Bounded()
        # The identities of the ranks on this machine, kept here: ``/proc`` can still be
        # asked about them when the store cannot (its host stopped or gone).
        self.neighbours: dict[int, Whois] = {}
        self._neighbours_known = False

    def record_self(self) -> None:
        """Write this rank's identity (best effort: the store's host may be gone)."""
        with self._lock, contextlib.suppress(Exception):
            self.store.set(f"{WHOIS_PREFIX}{self.rank}", Whois.of_this_process(self.rank).encode())

    def mark_exit(self, how: str) -> None:
        """Write this rank's exit marker (best effort, see :meth:`_write`)."""
        self._write(f"{EXIT_PREFIX}{self.rank}", how)

    def announce_abandoned(self, notice: str) -> None:
        """Tell every rank of the job that this one abandoned its step (a pipeline step
        that failed with messages outstanding): peers blocked on it over the network,
        whose waits cannot be interrupted, learn it from their watchdogs."""
        self._write(f"{ABANDON_PREFIX}{self.rank}", notice)

    def _write(self, key: str, text: str) -> None:
        """Set ``key`` and count it in :data:`EXITS_COUNTER`. Safe from a signal handler
        on the main thread and on the way out of a failing process: the lock and the
        store are each given :data:`_WRITE_S` (the store's host may be stopped), and a
        forked child never writes (it would speak for the parent's rank)."""
        if os.getpid() != self._pid or not self._lock.acquire(timeout=_WRITE_S):
            return
        try:

            def write() -> None:
                self.store.set(key, text[:_REASON_CHARS])
                self.store.add(EXITS_COUNTER, 1)

            with contextlib.suppress(Exception):
                self._writes(write, _WRITE_S)
        finally:
            self._lock.release()

    def _read(self, prefix: str, ranks: Sequence[int]) -> dict[int, str]:
        # ``get`` waits for a missing key: ``check`` first (one request per rank; this runs
        # only after a failure).
        found: dict[int, str] = {}
        # Not forever: a heartbeat tick stuck on a stopped store holds the lock.
        if not self._lock.acquire(timeout=_WRITE_S):
            raise StoreStalledError("the store client is held by a request that does not return")
        try:
            for r in ranks:
                key = f"{prefix}{r}"
                if self.store.check([key]):
                    found[r] = self.store.get(key).decode(errors="replace")
        finally:
            self._lock.release()
        return found

    def learn_neighbours(self) -> None:
        """Read the identities of the other ranks on this machine (torchrun's
        ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``: a machine's ranks are consecutive) until
        all have recorded one; the heartbeat thread calls this on each tick, and it does
        nothing once they are known."""
        if self._neighbours_known:
            return
        local, count = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
        if not (local.isdigit() and count.isdigit()):
            self._neighbours_known = True
            return
        first = self.rank - int(local)
        ranks = [r for r in range(first, first + int(count)) if r != self.rank]
        with contextlib.suppress(Exception):
            self.neighbours.update(self.whois([r for r in ranks if r not in self.neighbours]))
        self._neighbours_known = len(self.neighbours) == len(ranks)

    def whois(self, ranks: Sequence[int]) -> dict[int, Whois]:
        """The identities recorded by ``ranks`` (those that recorded one)."""
        return {r: Whois.decode(r, text) for r, text in self._read(WHOIS_PREFIX, ranks).items()}

    def exits(self, ranks: Sequence[int]) -> dict[int, str]:
        """The exit markers of ``ranks`` that wrote one."""
        return self._read(EXIT_PREFIX, ranks)

    def abandoned(self, ranks: Sequence[int]) -> dict[int, str]:
        """The abandon notices of ``ranks`` that wrote one."""
        return self._read(ABANDON_PREFIX, ranks)


@dataclasses.dataclass
class Departed:
    """What markers and ``/proc`` tell about some ranks, without waiting."""

    whois: dict[int, Whois]
    exited: dict[int, str]  # rank -> how (its marker, or what /proc says)
    stopped: dict[int, str]  # rank -> what /proc says (stopped by a signal, traced)


def look(records: StoreRecords, ranks: Sequence[int]) -> Departed:
    """Which of ``ranks`` are known to be gone (an exit marker, or ``/proc`` on the same
    machine), and the identities of all of them.

    Raises:
        Exception: the store cannot be reached (then :func:`look_locally`).
    """
    return _classify(records.whois(ranks), records.exits(ranks))


def look_locally(records: StoreRecords, ranks: Sequence[int]) -> Departed:
    """:func:`look` without the store: ``/proc`` about the ranks on this machine."""
    return _classify({r: w for r, w in records.neighbours.items() if r in ranks}, {})


def _classify(whois: dict[int, Whois], exits: dict[int, str]) -> Departed:
    exited = {r: f"its exit marker says: {how}" for r, how in exits.items()}
    stopped: dict[int, str] = {}
    for r, who in whois.items():
        if r in exited:
            continue
        state = who.process_state()
        if state is None or state == "running":
            continue
        if state.startswith("stopped"):
            stopped[r] = f"its process is {state}"
        else:
            exited[r] = f"its process {'is ' if state.startswith('a ') else ''}{state}"
    return Departed(whois, exited, stopped)


# -- writing the marker when this process ends ---------------------------------------------

_RECORDS: StoreRecords | None = None
_ENDING: list[str] = []  # the uncaught exception that is ending the interpreter, if any
_INSTALLED_IN: int | None = None  # the process that installed the exit hooks


def mark_on_exit(records: StoreRecords) -> None:
    """From now on, write this rank's exit marker when the process ends (at interpreter
    exit, on SIGTERM or SIGHUP with their default disposition). Once per process; a later
    job of the same process (a test pool's) replaces ``records``."""
    global _RECORDS, _INSTALLED_IN
    _RECORDS = records
    if os.getpid() == _INSTALLED_IN:
        return
    _INSTALLED_IN = os.getpid()
    import atexit

    atexit.register(_mark_interpreter_exit)
    previous_hook = sys.excepthook

    def remember_and_report(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        _ENDING.append(f"{kind.__name__}: {value}")
        previous_hook(kind, value, tb)

    sys.excepthook = remember_and_report
    if threading.current_thread() is threading.main_thread():
        _mark_on_signals()


def announce_abandoned(notice: str) -> None:
    """Publish that this rank abandoned its step (``StoreRecords.announce_abandoned``)."""
    if _RECORDS is not None:
        _RECORDS.announce_abandoned(notice)


def mark_exit(how: str) -> None:
    """Write this rank's exit marker now (the peer watchdog, before ending the process)."""
    if _RECORDS is not None:
        _RECORDS.mark_exit(how)


def _mark_interpreter_exit() -> None:
    how = f"exited after an uncaught {_ENDING[-1]}" if _ENDING else EXITED_CLEANLY
    mark_exit(how)
    # Marked: from here on a SIGTERM must end the process as it did before (a teardown
    # that hangs with the interpreter lock held would otherwise keep it alive).
    if threading.current_thread() is threading.main_thread():
        for signum in _MARKED_SIGNALS:
            if signal.getsignal(signum) is marked_signal_handler:
                signal.signal(signum, signal.SIG_DFL)


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def marked_signal_handler(signum: int, frame: Any) -> None:
    """The Python handler of SIGTERM and SIGHUP: mark the exit, then end the process as the
    default disposition would (killed by the signal)."""
    if os.getpid() == _INSTALLED_IN:
        mark_exit(f"killed by {_signal_name(signum)}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _mark_on_signals() -> None:
    marked = []
    for signum in _MARKED_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, marked_signal_handler)
            marked.append(signum)
    if not marked:
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (asyncio's): theirs stays; markers wait for main
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return
    threading.Thread(
        target=_wake_on_signals,
        args=(read_end, frozenset(marked), os.getpid()),
        name="zerotrain-exit-marker",
        daemon=True,
    ).start()
    global _WAKE_PIPE
    _WAKE_PIPE = (read_end, write_end)
    os.register_at_fork(after_in_child=_forget_in_child)


# The wakeup pipe of this process (read end, write end); None in a forked child.
_WAKE_PIPE: tuple[int, int] | None = None


def _forget_in_child() -> None:
    """In a forked child (a data loader's worker): the default dispositions again, and no
    wakeup pipe. The pipe is shared with the parent, whose reader would otherwise take a
    SIGTERM sent to the child (``DataLoader`` ends stubborn workers so) for its own and
    end the parent (found in review, before it shipped). Once: the child's own children
    inherit this hook, and must not close what the child has since opened under the same
    descriptor numbers."""
    global _WAKE_PIPE
    pipe, _WAKE_PIPE = _WAKE_PIPE, None
    if pipe is None:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        for signum in _MARKED_SIGNALS:
            if signal.getsignal(signum) is marked_signal_handler:
                signal.signal(signum, signal.SIG_DFL)
    for fd in pipe:
        with contextlib.suppress(OSError):
            os.close(fd)


def _wake_on_signals(read_end: int, marked: frozenset[int], pid: int) -> None:
    """Read the signal numbers Python's C handler writes to the wakeup pipe; for a marked
    signal whose Python handler is still ours, write the marker and end the process the
    way the default disposition does, at once, even while the main thread is blocked in C
    (where the Python handler would wait for it). Under another handler put in front of
    ours (the swap files' SIGTERM clean-up), the main thread's chain does both."""
    default_disposition = _default_disposition()
    while os.getpid() == pid:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in marked or signal.getsignal(signum) is not marked_signal_handler:
                continue
            mark_exit(f"killed by {_signal_name(signum)}")
            default_disposition(signum)
            os.kill(os.getpid(), signum)


def _default_disposition() -> Callable[[int], None]:
    """Set a signal's disposition back to the default from any thread (``signal.signal``
    is for the main thread only): libc's ``signal(signum, SIG_DFL)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    return lambda signum: libc.signal(signum, 0)  # SIG_DFL is 0

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
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from zerotrain.comm import departures
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

INTERVAL = 0.5  # seconds between ticks
# After a failure, how long heartbeats are watched for the ranks that markers and /proc
# could not account for: a live rank ticks four times in it.
LOOK = 4 * INTERVAL
# How :func:`explain_failure` starts when it can name no rank.
CANNOT_TELL = " Every other rank's heartbeat moved"
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
        self._store: tuple[dist.Store, str, threading.Lock, Callable[[], None]] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stop = threading.Event()

    def add(self, target: Tickable) -> None:
        self._forget_if_forked()
        with self._lock:
            self._ticks.add(target)
        self._start()

    def watch_store(
        self,
        store: dist.Store,
        rank: int,
        lock: threading.Lock,
        after_tick: Callable[[], None] = lambda: None,
    ) -> None:
        """Tick ``rank``'s counter in ``store``, a client that other threads use under
        ``lock`` (a client is not safe for concurrent use); ``after_tick`` runs after each
        tick, without the lock (it takes it itself)."""
        self._forget_if_forked()
        with self._lock:
            self._store = (store, f"{_STORE_PREFIX}{rank}", lock, after_tick)
        self._start()

    def _forget_if_forked(self) -> None:
        """In a forked child, start afresh: the parent's thread is not ours, nor are its
        targets. Before registering anything: resetting after (as ``_start`` once did)
        dropped what was just registered, and a forked rank's first target (the job's
        store) was never ticked, so after a gloo failure every peer looked silent."""
        if self._pid != os.getpid():
            self.__init__()  # type: ignore[misc]

    def _start(self) -> None:
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
            self._tick_all()
            self._stop.wait(INTERVAL)

    def _tick_all(self) -> None:
        # A function of its own so that nothing it ticked is still referenced while the
        # thread waits: a strong reference held across the wait would keep every arena in
        # the weak set alive for good (found: each dropped engine's arena stayed mapped).
        with self._lock:
            targets = list(self._ticks)
            store = self._store
        for target in targets:
            target.tick()
        if store is not None:
            client, key, lock, after_tick = store
            with lock, contextlib.suppress(Exception):  # the store's host may be gone
                client.add(key, 1)
            after_tick()


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
        self.records = departures.StoreRecords(store, rank, self._lock)
        self.records.record_self()
        departures.mark_on_exit(self.records)
        _BEATER.watch_store(store, rank, self._lock, self.records.learn_neighbours)

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
    """After a collective over ``ranks`` (global) failed: which of them are gone, as
    sentences naming each with its host. Exit markers and ``/proc`` (same machine) answer at
    once; the ranks they cannot account for are named when their heartbeat stands still
    for ``window`` seconds (default :data:`LOOK`, ended early once every one moved). Says
    so when no rank can be blamed; '' without a store."""
    store = _STORE
    if store is None:
        return ""
    others = [r for r in ranks if r != store.rank]
    window = window if window is not None else min(heartbeat_timeout(), LOOK)
    bounded = departures.Bounded()
    reachable = True
    try:
        # Two requests per rank: a second more per thousand ranks.
        seen = bounded(lambda: departures.look(store.records, others), LOOK + len(others) / 1e3)
    except Exception:
        reachable = False
        seen = departures.look_locally(store.records, others)
    unknown = [r for r in others if r not in {**seen.exited, **seen.stopped}]
    silent: list[int] | None = []
    if unknown and reachable:
        try:
            silent = bounded(lambda: store.silent(unknown, window), window + LOOK)
        except Exception:
            silent = None
    if silent is None:
        reachable, silent = False, []
    sentences = []
    if seen.exited:
        sentences.append(_named("exited", seen.exited, seen.whois))
    if seen.stopped:
        sentences.append(_named("stopped answering", seen.stopped, seen.whois))
    if silent:
        labels = ", ".join(departures.label(r, seen.whois) for r in silent)
        sentences.append(
            f" Rank(s) {silent} stopped answering (no heartbeat for {window:.0f} s): "
            f"{labels}; they died, were stopped (SIGSTOP), hang with the interpreter locked, "
            "or their host was cut off."
        )
    if not reachable:
        sentences.append(
            " The job's rendezvous store cannot be reached: the host running it (global rank "
            "0's, or the launcher's) is probably gone or stopped."
        )
    if not sentences:
        return (
            f"{CANNOT_TELL} within {window:.0f} s, so which rank failed cannot be told from "
            "here: one may have raised and left its collectives, or the ranks took different "
            "code paths; see the other ranks' output."
        )
    return "".join(sentences)


def _named(what: str, how: dict[int, str], whois: dict[int, departures.Whois]) -> str:
    """`` Rank(s) [1] exited: rank 1 (host a, pid 7): its process is a zombie.``"""
    ranks = sorted(how)
    details = "; ".join(f"{departures.label(r, whois)}: {how[r]}" for r in ranks)
    return f" Rank(s) {ranks} {what}: {details}."


# Start times of the collective waits in progress on this process (``waiting()``).
_WAITING: list[float] = []


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Mark a blocking wait for a collective (what the peer watchdog guards)."""
    _WAITING.append(time.monotonic())
    try:
        yield
    finally:
        _WAITING.pop()


def peer_timeout() -> float | None:
    """``ZEROTRAIN_PEER_TIMEOUT``: seconds a peer's heartbeat in the job's store may stand
    still, while this rank waits for a collective, before this rank gives up on the job.
    Unset: the heartbeat timeout (``ZEROTRAIN_HEARTBEAT_TIMEOUT``, 10 s), as shared memory
    names a silent peer; ``zerotrain run`` sets 60 for multi-host jobs; ``0`` or ``off``:
    no watchdog (None).

    Raises:
        ValueError: not a number, or under 2 seconds.
    """
    raw = os.environ.get("ZEROTRAIN_PEER_TIMEOUT", "").strip().lower()
    if not raw:
        return heartbeat_timeout()
    if raw in ("0", "off"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 2:
        raise ValueError(
            f"ZEROTRAIN_PEER_TIMEOUT must be a number of seconds >= 2, or 0 / off to turn the "
            f"watchdog off; got {raw!r}"
        )
    return value


_ON_GIVE_UP: list[Callable[[], None]] = []


@contextlib.contextmanager
def undone_if_given_up(undo: Callable[[], None]) -> Iterator[None]:
    """Run ``undo`` if the peer watchdog ends this process inside the block: it exits
    without unwinding, so what a raised error would have cleaned up (a checkpoint's
    partial directory) is cleaned up here."""
    _ON_GIVE_UP.append(undo)
    try:
        yield
    finally:
        _ON_GIVE_UP.remove(undo)


def _give_up(message: str) -> None:
    departures.mark_exit(f"{departures.GAVE_UP}: {message}")
    for undo in reversed(_ON_GIVE_UP):
        with contextlib.suppress(Exception):
            undo()
    log.error("%s", message)
    for handler in log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(75)  # an elastic launcher restarts the job; gloo's wait cannot be interrupted


def _report(message: str) -> None:
    log.error("%s", message)


class PeerWatchdog:
    """Names a peer that is gone while this rank would otherwise wait for it until the
    collective timeout (``ZEROTRAIN_COMM_TIMEOUT``, 10 minutes by default): a peer whose
    heartbeat has stood still for ``timeout`` seconds (its host died or was cut off without
    a TCP reset; a stopped process), a store unreachable as long, or (gloo) a pipeline
    peer that abandoned the step this rank is in.

    Two modes:

    - ``only_while_waiting`` (gloo): only a blocked wait counts (``waiting()``), so a peer
      that finished and exited while this rank works on alone is no reason to stop; the
      store is read only during waits longer than a second, one request per poll
      (``multi_get``), so a large job does not load it while it trains. The rank then
      exits (code 75, ``give_up``): gloo's wait cannot be interrupted, and a raise would
      leave the collective pending, so that the process could not end before the
      collective timeout either (its group waits for it at exit). The collective timeout
      can stay long for legitimately slow collectives, which keep every peer ticking.
    - otherwise (NCCL, where the host never waits inside zerotrain: NCCL's kernels do, on
      the device): the store is read every ``timeout / 4`` seconds (at least 1) and each
      lost peer is reported once, with its host, by ``report`` (a log line): a peer silent
      for ``timeout`` seconds without a clean exit marker, or at once one whose exit
      marker says it was killed or raised (``departures.py``). The rank is not ended: it
      cannot tell whether it still needs the peer (a rank writing its last checkpoint
      shard alone does not); NCCL's own watchdog ends a collective that waits on it.

    Silence is judged over all ranks of the job, not the blocked collective's group (a
    subgroup's collective waiting on a slow peer while an unrelated rank has exited
    normally would be misjudged; not seen in zerotrain's own groups).

    Args:
        rank / world_size: this rank and the job's size (global).
        make_store: a new client of the job's store (its own connection, short timeout).
        timeout: seconds of silence that end the job.
        give_up: gloo: called with the message (default: mark this rank's exit, log the
            message and exit with code 75).
        only_while_waiting: the mode (above).
        report: NCCL: called with each message (default: log it).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        make_store: Callable[[], dist.Store | None],
        timeout: float,
        give_up: Callable[[str], None] = _give_up,
        only_while_waiting: bool = True,
        report: Callable[[str], None] = _report,
    ) -> None:
        self.rank = rank
        self.others = [r for r in range(world_size) if r != rank]
        self._make_store = make_store
        self.timeout = timeout
        self._give_up = give_up
        self._report = report
        self.only_while_waiting = only_while_waiting
        self._bounded = departures.Bounded()
        self._reported: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerotrain-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the thread (idempotent)."""
        self._stop.set()

    def _counts(self, store: dist.Store, fresh: bool) -> list[int]:
        """The others' heartbeat counters, then the job's count of exit markers."""
        keys = [f"{_STORE_PREFIX}{r}" for r in self.others] + [departures.EXITS_COUNTER]
        if fresh:  # a get waits for a missing key: create any a rank has not ticked yet
            for key in keys:
                store.add(key, 0)
        return [int(value) for value in store.multi_get(keys)]

    def _run(self) -> None:
        state = _WatchState()
        pause = 1.0
        while not self._stop.wait(pause):
            # The main thread pushes and pops waits: one look at it per poll.
            wait_start = _WAITING[0] if _WAITING else None
            try:
                pause = self._poll(state, time.monotonic(), wait_start)
            except Exception:  # never let a surprise end the watchdog
                log.debug("peer watchdog: a poll failed", exc_info=True)
                pause = 1.0
            if pause < 0:
                return

    def _poll(self, state: _WatchState, now: float, wait_start: float | None) -> float:
        """One look; returns the pause before the next (negative: stop watching)."""
        if self.only_while_waiting and (wait_start is None or now - wait_start < 1.0):
            state.forget()  # silence is measured within one blocked wait
            return 1.0
        try:
            fresh = state.store is None
            store = (
                state.store if state.store is not None else self._bounded(self._make_store, LOOK)
            )
            state.store = store
            counts = self._bounded(functools.partial(self._counts, store, fresh), LOOK)
        except Exception:
            state.store, counts = None, None
        if counts is None:
            state.unreachable_since = state.unreachable_since or now
        else:
            state.unreachable_since = None
            # A peer first seen in this wait counts as silent since the wait began: its
            # first read comes a second in, and counting from there would name a stopped
            # peer a second late. A live peer ticks twice a second, so its next read
            # clears it long before the timeout (at least 2 s).
            since = wait_start if self.only_while_waiting and wait_start is not None else now
            for r, count in zip(self.others, counts[:-1], strict=True):
                if r not in state.changed:
                    state.changed[r] = (count, since)
                elif state.changed[r][0] != count:
                    state.changed[r] = (count, now)
        if self._stop.is_set():
            return -1.0
        message = self._judge_all(state, now, wait_start, counts)
        if message is not None:
            if self.only_while_waiting:
                self._give_up(message)
                return -1.0
            self._report(message)
        return self._pause(state, now, wait_start)

    def _judge_all(
        self, state: _WatchState, now: float, wait_start: float | None, counts: list[int] | None
    ) -> str | None:
        """The message naming what is lost, if anything is (and not reported yet)."""
        store = state.store
        if store is not None and counts is not None and counts[-1] != state.notices_seen:
            state.notices_seen = counts[-1]
            if self.only_while_waiting and _IN_PIPELINE_STEP:
                with contextlib.suppress(Exception):  # the store went away: judged below
                    notices, whois = self._bounded(functools.partial(self._abandoned, store), LOOK)
                    if notices:
                        return self._abandon_message(notices, whois, now, wait_start)
        if self.only_while_waiting and (wait_start is None or now - wait_start < self.timeout):
            return None
        if state.unreachable_since is not None and now - state.unreachable_since >= self.timeout:
            if not self.only_while_waiting:
                return None  # NCCL: the store's host may simply have finished first
            return (
                f"the job's store ({os.environ.get('MASTER_ADDR')}) has been unreachable "
                f"for {now - state.unreachable_since:.0f} s while this rank waits for a "
                "collective: its host is probably gone; this rank exits "
                "(ZEROTRAIN_PEER_TIMEOUT)"
            )
        if store is None or counts is None:
            return None
        silent = [
            r
            for r, (_, at) in state.changed.items()
            if now - at >= self.timeout and r not in self._reported
        ]
        if counts[-1] == state.exits_seen and not silent:
            return None
        state.exits_seen = counts[-1]
        try:
            ended, silent, whois = self._bounded(
                functools.partial(self._judge, store, silent), LOOK
            )
        except Exception:
            return None  # the store went away mid-read: the next poll says so
        ended = {r: how for r, how in ended.items() if r not in self._reported}
        if not ended and not silent:
            return None
        self._reported |= {*ended, *silent}
        return self._message(ended, silent, whois)

    def _pause(self, state: _WatchState, now: float, wait_start: float | None) -> float:
        """Until the next look: a second (NCCL: a quarter of the timeout, at least a
        second: every rank polls, so a large job's store must not be read N times a
        second), or less where a peer's silence reaches the timeout sooner (so that it
        is named then, not up to a second later)."""
        if not self.only_while_waiting:
            return max(1.0, self.timeout / 4)
        due = [at + self.timeout for _, at in state.changed.values()]
        if wait_start is not None:
            due.append(wait_start + self.timeout)
        # Deadlines already past (a silent peer that a clean exit marker excused) wait the
        # full second: they must not turn the watchdog into a busy loop on the store.
        soonest = min((d for d in due if d > now), default=now + 1.0) - now + 0.05
        return min(1.0, max(0.05, soonest))

    def _abandoned(self, store: dist.Store) -> tuple[dict[int, str], dict[int, departures.Whois]]:
        """The peers that abandoned their step (a failed pipeline step): their notices, and
        the identities of those that recorded one."""
        records = departures.StoreRecords(store, self.rank, threading.Lock())
        notices = records.abandoned(self.others)
        return notices, records.whois(sorted(notices)) if notices else {}

    def _abandon_message(
        self,
        notices: dict[int, str],
        whois: dict[int, departures.Whois],
        now: float,
        wait_start: float | None,
    ) -> str:
        waited = f" for {now - wait_start:.0f} s" if wait_start is not None else ""
        return (
            _named("abandoned their step", notices, whois).strip() + " This rank, in the "
            f"same pipeline step, has waited{waited} on messages or collectives that will "
            "not come, and exits: its wait over the network cannot be interrupted "
            "(ZEROTRAIN_PEER_TIMEOUT; 0 turns this off)."
        )

    def _judge(
        self, store: dist.Store, silent: list[int]
    ) -> tuple[dict[int, str], list[int], dict[int, departures.Whois]]:
        """Exit markers decide: a clean exit is not a loss (the rank finished), nor is a
        peer's watchdog giving up (a survivor that judged the same loss: naming it would
        hide the rank actually lost); any other marker is, silent or not (NCCL mode; gloo's
        waits fail on their own there)."""
        records = departures.StoreRecords(store, self.rank, threading.Lock())
        exits = records.exits(self.others)
        ended = {
            r: how
            for r, how in exits.items()
            if how != departures.EXITED_CLEANLY
            and not how.startswith(departures.GAVE_UP)
            and (r in silent or not self.only_while_waiting)
        }
        silent = [r for r in silent if r not in exits]
        return ended, silent, records.whois(sorted({*ended, *silent}))

    def _message(
        self, ended: dict[int, str], silent: list[int], whois: dict[int, departures.Whois]
    ) -> str:
        parts = []
        if ended:
            said = {r: f"its exit marker says: {how}" for r, how in ended.items()}
            parts.append(_named("exited", said, whois).strip())
        if silent:
            labels = ", ".join(departures.label(r, whois) for r in silent)
            during = " while this rank waits for a collective" if self.only_while_waiting else ""
            parts.append(
                f"Rank(s) {silent} stopped answering (no heartbeat for {self.timeout:.0f} s"
                f"{during}): {labels}; they died, were stopped (SIGSTOP), hang with the "
                "interpreter locked, or their host was cut off."
            )
        if not self.only_while_waiting:
            return " ".join(parts) + (
                " A collective with them waits until NCCL's timeout ends it "
                "(ZEROTRAIN_PEER_TIMEOUT; 0 turns this report off)."
            )
        return (
            " ".join(parts) + " This rank exits instead of waiting out the collective timeout "
            "(ZEROTRAIN_PEER_TIMEOUT; 0 turns this off)."
        )


class _WatchState:
    """What a :class:`PeerWatchdog` remembers between looks."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.changed: dict[int, tuple[int, float]] = {}  # rank -> (count, when it changed)
        self.unreachable_since: float | None = None
        self.exits_seen = 0
        self.notices_seen = 0

    def forget(self) -> None:
        """Between blocked waits: nothing is held (the store's connection closes)."""
        self.changed.clear()
        self.unreachable_since = None
        self.store = None


# How many pipeline steps this process is inside (``in_pipeline_step``): an abandon notice
# only ends a rank that waits inside one.
_IN_PIPELINE_STEP = 0


@contextlib.contextmanager
def in_pipeline_step() -> Iterator[None]:
    """Mark a pipeline step in progress: only inside one does a peer's abandon notice end
    a waiting rank (a checkpoint saved after a failed step must not be ended by it)."""
    global _IN_PIPELINE_STEP
    _IN_PIPELINE_STEP += 1
    try:
        yield
    finally:
        _IN_PIPELINE_STEP -= 1


_WATCHDOG: PeerWatchdog | None = None


def start_peer_watchdog(
    rank: int,
    world_size: int,
    make_store: Callable[[], dist.Store | None],
    timeout: float,
    only_while_waiting: bool = True,
) -> PeerWatchdog:
    """This process's one :class:`PeerWatchdog`, for the job now starting (one started for
    an earlier job of this process, a test pool's, is stopped: it reads another store)."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        atexit.unregister(_WATCHDOG.stop)
    _WATCHDOG = PeerWatchdog(
        rank, world_size, make_store, timeout, only_while_waiting=only_while_waiting
    )
    return _WATCHDOG


def store_client(timeout: datetime.timedelta) -> dist.Store | None:
    """A new client connection to the job's store from ``MASTER_ADDR``/``MASTER_PORT``
    (None without them)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)

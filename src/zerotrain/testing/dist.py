"""``run_distributed``: run a function in N local processes joined by a gloo process group.

Used by every multi-process test. Failures are never silent and never hang:

* a rank that raises makes the call raise at once, with that rank's number and traceback
  (the other ranks, possibly blocked in a collective, are killed);
* a rank that dies without reporting (segfault, ``os._exit``) is detected the same way;
* if not every rank finishes within ``timeout`` seconds, each live rank dumps its Python
  stacks into its log, all are killed, and the error shows which ranks were stuck and where.

Processes start from a forkserver that has already imported torch, so a 4-rank job starts in
well under a second. The rendezvous store is created by the parent on a free port of
127.0.0.1, so there is no race for the port.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.comm import liveness, shm

_LOG_TAIL_CHARS = 4000
_LAUNCHER_POLL_S = 1.0


class DistributedTestError(RuntimeError):
    """A rank raised, crashed or hung inside :func:`run_distributed`."""


# What the forkserver imports once, so that no rank pays for it: torch's compiler stack is
# imported lazily by the first engine (1.6 s of every fresh rank's time, measured).
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "zerotrain", "zerotrain.engine"]
_use_pools = False

# The reason to give ``own_processes`` for a job that leaves a collective unmatched on
# purpose (a timeout or a mismatch it then reports): its ranks' gloo pairs are out of step.
# Jobs run in this process, by (how, world size): the suite's summary reports them.
JOBS: collections.Counter[tuple[str, int]] = collections.Counter()

BREAKS_THE_GROUP = "a collective left unmatched on purpose leaves the group unusable"


def use_pools(enabled: bool) -> None:
    """Run :func:`run_distributed` jobs in worker pools (``testing/pool.py``) unless a test
    asks for processes of its own; tests/conftest.py turns this on (``ZEROTRAIN_TEST_POOL=0``
    turns it off)."""
    global _use_pools
    _use_pools = enabled


@functools.cache
def context() -> ForkServerContext:
    """The forkserver every test rank starts from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, __name__])
    return ctx


def rank_environment(rank: int, world_size: int, port: int, comm_timeout_s: float) -> None:
    """The environment torchrun would give ``rank``, on one thread of the CPU."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        ZEROTRAIN_DEVICE="cpu",
        ZEROTRAIN_COMM_TIMEOUT=str(comm_timeout_s),
    )
    torch.set_num_threads(1)


def become_rank(
    rank: int,
    world_size: int,
    port: int,
    log_path: str,
    comm_timeout_s: float,
    launcher: int,
    *,
    append: bool,
) -> None:
    """Make this process test rank ``rank`` (a job's own, or a pool's): its output goes to
    ``log_path`` (appended to, or from scratch), SIGUSR1 dumps its stacks, it ends when
    ``launcher`` is gone, and it has torchrun's environment."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    log_fd = os.open(log_path, flags, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=follow_launcher, args=(launcher,), daemon=True).start()
    rank_environment(rank, world_size, port, comm_timeout_s)


def join_group(rank: int, world_size: int, port: int, comm_timeout_s: float) -> None:
    """The default process group over the job's store: gloo on CPUs; a test that asks for
    CUDA (env ZEROTRAIN_DEVICE=cuda) gets NCCL, the backend zerotrain pairs with it."""
    timeout = datetime.timedelta(seconds=comm_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    backend = "nccl" if os.environ["ZEROTRAIN_DEVICE"] == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    log_path: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    comm_timeout_s: float,
    launcher: int,
) -> None:
    become_rank(rank, world_size, port, log_path, comm_timeout_s, launcher, append=False)
    os.environ.update(env)
    try:
        join_group(rank, world_size, port, comm_timeout_s)
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:
        payload = pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))
    results.put((rank, payload, time.time()))
    if dist.is_initialized():
        dist.destroy_process_group()


def follow_launcher(launcher: int) -> None:
    """End this rank when the process that launched the job is gone (killed by a signal
    it could not handle): nobody will collect the result, and the ranks, children of the
    forkserver, would otherwise train on unseen (found: a killed benchmark's 4 ranks ran on
    for half an hour). SIGTERM first, so the rank's own clean-up (swap files) runs."""
    while liveness.process_state(launcher) not in ("exited", "a zombie (exited, not reaped)"):
        time.sleep(_LAUNCHER_POLL_S)
    print(f"the launching process {launcher} is gone; ending rank", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)
    os._exit(1)  # SIGTERM handled without exiting (a user handler): leave anyway


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "<no output>"
    return text[-_LOG_TAIL_CHARS:] if text.strip() else "<no output>"


def kill(procs: Sequence[BaseProcess], sweep: bool = True) -> None:
    """Stop the ranks, and (``sweep``) remove the shared-memory segments they created and
    could not (a rank ends with ``os._exit``, or was killed, before its finalizers run)."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=5)
    if sweep:
        shm.remove_segments_of({p.pid for p in started if p.pid is not None and not p.is_alive()})


#: The collective timeout of a job that names none (capped at half the job's length).
DEFAULT_COMM_TIMEOUT_S = 60.0


def default_comm_timeout(timeout: float) -> float:
    """The collective timeout of a job of ``timeout`` seconds that names none."""
    return min(DEFAULT_COMM_TIMEOUT_S, timeout / 2)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    comm_timeout: float | None = None,
    env: dict[str, str] | None = None,
    own_processes: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (a module-level function) and its arguments and result
    picklable. Inside ``fn`` the default process group (gloo) is initialised and ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` are set, so ``zerotrain.initialize`` just works.

    Under pytest (see :func:`use_pools`) the job runs in a worker pool of ``world_size``
    ranks that outlives it (``testing/pool.py``): ``fn`` must leave the process as it found
    it (the pool checks, and fails the test that did not). ``env`` is set for the job and
    removed after it; anything that must hold before the process group exists needs
    ``own_processes``.

    Args:
        fn: the function each rank runs.
        world_size: number of processes.
        timeout: seconds for the whole job.
        comm_timeout: seconds a collective may wait inside the job (the process group's
            timeout and ``ZEROTRAIN_COMM_TIMEOUT``); default ``DEFAULT_COMM_TIMEOUT_S``, or
            half of ``timeout`` when that is shorter, so a stuck collective fails with
            zerotrain's own error before the job is killed. Pools are kept per world size
            and collective timeout: one default lets jobs of any length share a pool.
        env: extra environment variables for the ranks.
        own_processes: why this job needs ranks of its own, started for it and ended after
            it (a process-wide setting read at start, a count of the process's threads or
            files); None runs it in a pool where pools are on.

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died, or the
            job did not finish within ``timeout``; in a pool also: a rank left something
            behind that the next test would meet (each finding named).
    """
    comm_timeout = comm_timeout if comm_timeout is not None else default_comm_timeout(timeout)
    env = env or {}
    name = job_name(fn)
    pooled = _use_pools and own_processes is None and env.get("ZEROTRAIN_DEVICE", "cpu") == "cpu"
    JOBS["pooled" if pooled else "own processes", world_size] += 1
    if pooled:
        from zerotrain.testing.pool import POOLS

        return POOLS.get(world_size, comm_timeout).run(fn, args, kwargs, env, timeout, name)
    with _job(fn, world_size, args, kwargs, timeout, comm_timeout, env) as (procs, results, logs):
        outcome = collect(procs, _reader(results), logs, world_size, timeout, name)
        for p in procs:
            p.join(timeout=10)
        return outcome


def job_name(fn: Callable[..., Any]) -> str:
    """How a failure names the job: the running test (pytest's id) and the function."""
    qualname = getattr(fn, "__qualname__", repr(fn))
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return f"{test} ({qualname})" if test else qualname


def _reader(results: Any) -> Callable[[float], tuple[int, bytes, float]]:
    return lambda timeout: results.get(timeout=timeout)


@contextlib.contextmanager
def _job(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    comm_timeout: float,
    env: dict[str, str],
    sweep: bool = True,
) -> Iterator[tuple[Sequence[BaseProcess], Any, list[str]]]:
    """Start ``world_size`` ranks running ``fn``; on exit kill what is left and remove the
    logs (and, with ``sweep``, the shared-memory segments of the ranks)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    log_dir = tempfile.mkdtemp(prefix="zerotrain-dist-")
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world_size)]
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                r,
                world_size,
                store.port,
                results,
                logs[r],
                args,
                kwargs,
                env,
                comm_timeout,
                os.getpid(),
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        yield procs, results, logs
    finally:
        kill(procs, sweep=sweep)
        del store
        shutil.rmtree(log_dir, ignore_errors=True)


Receive = Callable[[float], tuple[int, bytes, float]]  # (rank, pickled outcome, time)


def _failure(
    name: str,
    world_size: int,
    procs: Sequence[BaseProcess],
    receive: Receive,
    logs: list[str],
    done: dict[int, Any],
    errors: dict[int, tuple[str, str]],
) -> DistributedTestError:
    """Build the error for a failed job. A rank's exception often makes the others fail in
    their next collective; wait a moment so the report can name the first cause (and the
    survivors' own reports, which name a dead peer after its heartbeat fell silent)."""
    # A rank that raised is the first cause already; a rank that died is named best by
    # the survivors, whose reports follow once the broken connections fail them.
    settle = time.monotonic() + (1.0 if errors else 4.0)
    while time.monotonic() < settle:
        if all(r in done or r in errors or not p.is_alive() for r, p in enumerate(procs)):
            break  # every rank has reported or is gone: nothing more will come
        try:
            rank, payload, _ = receive(0.1)
        except queue.Empty:
            continue
        status, value = pickle.loads(payload)
        if status == "ok":
            done[rank] = value
        else:
            errors[rank] = (status, value)
    dead = [
        r for r, p in enumerate(procs) if r not in errors and r not in done and not p.is_alive()
    ]
    kill(procs)
    parts = [
        f"{name}: rank {r} exited with code {procs[r].exitcode} without reporting a result "
        f"(likely the first failure)\n--- rank {r} output ---\n{_tail(logs[r])}"
        for r in dead
    ]
    for r, (status, text) in errors.items():  # first reported first
        what = "raised:\n" if status == "error" else "left behind for the next test:"
        parts.append(
            f"{name}: rank {r} of {world_size} {what}{text}\n--- rank {r} output ---\n"
            f"{_tail(logs[r])}"
        )
    return DistributedTestError("\n".join(parts))


def collect(
    procs: Sequence[BaseProcess],
    receive: Receive,
    logs: list[str],
    world_size: int,
    timeout: float,
    name: str,
) -> list[Any]:
    """Every rank's result of the running job, in rank order; raises
    :class:`DistributedTestError` (after killing the ranks) at the first rank that failed,
    died or left something behind, or when ``timeout`` passes first."""
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    silent_since: dict[int, float] = {}
    while len(done) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = [r for r in range(world_size) if r not in done]
            for r in stuck:
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGUSR1)  # type: ignore[arg-type]
            time.sleep(1.0)
            kill(procs)
            details = "\n".join(
                f"--- rank {r} output (stacks at timeout) ---\n{_tail(logs[r])}" for r in stuck
            )
            raise DistributedTestError(
                f"{name}: rank(s) {stuck} did not finish within {timeout:.0f}s "
                f"(hung in a collective or a loop?)\n{details}"
            )
        try:
            rank, payload, _ = receive(min(0.2, remaining))
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in done or p.is_alive():
                    continue
                # Give a result that is still in the pipe a moment to arrive.
                if now - silent_since.setdefault(r, now) > 2.0:
                    # The survivors' reports (naming the dead rank) follow within moments.
                    raise _failure(name, world_size, procs, receive, logs, done, {}) from None
            continue
        status, value = pickle.loads(payload)
        if status != "ok":
            raise _failure(name, world_size, procs, receive, logs, done, {rank: (status, value)})
        done[rank] = value
    return [done[r] for r in range(world_size)]


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_to_the_end` ended.

    ``status`` is "ok" (``value`` is its result), "error" (``value`` is its traceback),
    "died" (ended without reporting: killed, crashed), "stopped" (SIGSTOP) or "hung"
    (still running at the deadline). ``reported_at`` is the ``time.time()`` of its report
    (of its death being seen, for "died");
    ``exited`` whether its process had ended by itself before the harness killed what was
    left.
    """

    rank: int
    status: str
    value: Any = None
    reported_at: float | None = None
    exited: bool = False
    exitcode: int | None = None
    output: str = ""


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """Every rank's :class:`RankOutcome`, and the shared-memory segments the ranks created
    and left in /dev/shm (found before the harness removed them)."""

    ranks: list[RankOutcome]
    leftover_segments: list[str]


def run_to_the_end(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    comm_timeout: float | None = None,
    env: dict[str, str] | None = None,
    exit_grace: float = 10.0,
    **kwargs: Any,
) -> JobOutcome:
    """Run ``fn`` like :func:`run_distributed`, for jobs in which ranks are expected to fail
    (fault injection): never raise for a rank's error, wait until every rank has reported,
    died or been stopped (or ``timeout`` passed: those still running are "hung", with their
    stacks in ``output``), then give each rank that reported ``exit_grace`` seconds to end
    by itself, and say what each did.

    Returns:
        A :class:`JobOutcome`.
    """
    comm_timeout = comm_timeout if comm_timeout is not None else timeout / 2
    JOBS["own processes", world_size] += 1
    with _job(fn, world_size, args, kwargs, timeout, comm_timeout, env or {}, sweep=False) as job:
        procs, results, logs = job
        outcomes = _await_all(procs, results, world_size, timeout)
        _await_exits(procs, outcomes, exit_grace)
        hung = [r for r, o in outcomes.items() if o.status == "hung"]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)  # type: ignore[arg-type]
        if hung:
            time.sleep(1.0)
        ranks = [dataclasses.replace(outcomes[r], output=_tail(logs[r])) for r in range(world_size)]
        kill(procs, sweep=False)
        pids = {p.pid for p in procs if p.pid is not None}
        left = shm.segments_of(pids)
        shm.remove_segments_of(pids)
    return JobOutcome(ranks, left)


def _await_all(
    procs: Sequence[BaseProcess], results: Any, world_size: int, timeout: float
) -> dict[int, RankOutcome]:
    """Collect reports until every rank reported, died or is stopped, or ``timeout``."""
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    gone_since: dict[int, float] = {}
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, payload, at = results.get(timeout=0.1)
            status, value = pickle.loads(payload)
            outcomes[rank] = RankOutcome(rank, status, value, reported_at=at)
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in outcomes:
                continue
            if not p.is_alive():
                # A result still in the pipe arrives within moments of the exit.
                if now - gone_since.setdefault(r, now) > 1.0:
                    # When its death was seen (``time.time()``, as reports carry).
                    seen = time.time() - (now - gone_since[r])
                    outcomes[r] = RankOutcome(
                        r, "died", exitcode=p.exitcode, exited=True, reported_at=seen
                    )
            elif liveness.process_state(p.pid).startswith("stopped"):  # type: ignore[arg-type]
                outcomes[r] = RankOutcome(r, "stopped")
    for r in range(world_size):
        outcomes.setdefault(r, RankOutcome(r, "hung"))
    return outcomes


def _await_exits(
    procs: Sequence[BaseProcess], outcomes: dict[int, RankOutcome], grace: float
) -> None:
    """Give the ranks that reported ``grace`` seconds to end by themselves."""
    deadline = time.monotonic() + grace
    for r, outcome in outcomes.items():
        if outcome.status in ("ok", "error"):
            procs[r].join(timeout=max(0.0, deadline - time.monotonic()))
            if not procs[r].is_alive():
                outcomes[r] = dataclasses.replace(outcome, exited=True, exitcode=procs[r].exitcode)

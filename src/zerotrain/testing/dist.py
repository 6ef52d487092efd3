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


@functools.cache
def _context() -> ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zerotrain", __name__])
    return ctx


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
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_follow_launcher, args=(launcher,), daemon=True).start()
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
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=comm_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        # gloo on CPUs; a test that asks for CUDA (env ZEROTRAIN_DEVICE=cuda) gets NCCL,
        # the backend zerotrain pairs with it.
        backend = "nccl" if os.environ["ZEROTRAIN_DEVICE"] == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
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
    os.close(log_fd)


def _follow_launcher(launcher: int) -> None:
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


def _kill(procs: Sequence[BaseProcess], sweep: bool = True) -> None:
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


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    comm_timeout: float | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (a module-level function) and its arguments and result
    picklable. Inside ``fn`` the default process group (gloo) is initialised and ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` are set, so ``zerotrain.initialize`` just works.

    Args:
        fn: the function each rank runs.
        world_size: number of processes.
        timeout: seconds for the whole job.
        comm_timeout: seconds a collective may wait inside the job (the process group's
            timeout and ``ZEROTRAIN_COMM_TIMEOUT``); default half of ``timeout``, so a
            stuck collective fails with zerotrain's own error before the job is killed.
        env: extra environment variables for the ranks.

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message), died, or the
            job did not finish within ``timeout``.
    """
    with _job(fn, world_size, args, kwargs, timeout, comm_timeout, env) as (procs, results, logs):
        return _collect(procs, results, logs, world_size, timeout, fn)


@contextlib.contextmanager
def _job(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    comm_timeout: float | None,
    env: dict[str, str] | None,
    sweep: bool = True,
) -> Iterator[tuple[Sequence[BaseProcess], Any, list[str]]]:
    """Start ``world_size`` ranks running ``fn``; on exit kill what is left and remove the
    logs (and, with ``sweep``, the shared-memory segments of the ranks)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
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
                env or {},
                comm_timeout if comm_timeout is not None else timeout / 2,
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
        _kill(procs, sweep=sweep)
        del store
        shutil.rmtree(log_dir, ignore_errors=True)


def _failure(
    name: str,
    world_size: int,
    procs: Sequence[BaseProcess],
    results: Any,
    logs: list[str],
    done: dict[int, Any],
    errors: dict[int, str],
) -> DistributedTestError:
    """Build the error for a failed job. A rank's exception often makes the others fail in
    their next collective; wait a moment so the report can name the first cause (and the
    survivors' own reports, which name a dead peer after its heartbeat fell silent)."""
    settle = time.monotonic() + 4.0
    while time.monotonic() < settle:
        try:
            rank, payload, _ = results.get(timeout=0.1)
        except queue.Empty:
            continue
        status, value = pickle.loads(payload)
        if status == "error":
            errors[rank] = value
        else:
            done[rank] = value
    dead = [
        r for r, p in enumerate(procs) if r not in errors and r not in done and not p.is_alive()
    ]
    _kill(procs)
    parts = [
        f"{name}: rank {r} exited with code {procs[r].exitcode} without reporting a result "
        f"(likely the first failure)\n--- rank {r} output ---\n{_tail(logs[r])}"
        for r in dead
    ]
    parts += [
        f"{name}: rank {r} of {world_size} raised:\n{tb}--- rank {r} output ---\n{_tail(logs[r])}"
        for r, tb in errors.items()  # first reported first
    ]
    return DistributedTestError("\n".join(parts))


def _collect(
    procs: Sequence[BaseProcess],
    results: Any,
    logs: list[str],
    world_size: int,
    timeout: float,
    fn: Callable[..., Any],
) -> list[Any]:
    name = getattr(fn, "__qualname__", repr(fn))
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
            _kill(procs)
            details = "\n".join(
                f"--- rank {r} output (stacks at timeout) ---\n{_tail(logs[r])}" for r in stuck
            )
            raise DistributedTestError(
                f"{name}: rank(s) {stuck} did not finish within {timeout:.0f}s "
                f"(hung in a collective or a loop?)\n{details}"
            )
        try:
            rank, payload, _ = results.get(timeout=min(0.2, remaining))
        except queue.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in done or p.is_alive():
                    continue
                # Give a result that is still in the pipe a moment to arrive.
                if now - silent_since.setdefault(r, now) > 2.0:
                    # The survivors' reports (naming the dead rank) follow within moments.
                    raise _failure(name, world_size, procs, results, logs, done, {}) from None
            continue
        status, value = pickle.loads(payload)
        if status == "error":
            raise _failure(name, world_size, procs, results, logs, done, {rank: value})
        done[rank] = value
    for p in procs:
        p.join(timeout=10)
    return [done[r] for r in range(world_size)]


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_to_the_end` ended.

    ``status`` is "ok" (``value`` is its result), "error" (``value`` is its traceback),
    "died" (ended without reporting: killed, crashed), "stopped" (SIGSTOP) or "hung"
    (still running at the deadline). ``reported_at`` is the ``time.time()`` of its report;
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
    with _job(fn, world_size, args, kwargs, timeout, comm_timeout, env, sweep=False) as job:
        procs, results, logs = job
        outcomes = _await_all(procs, results, world_size, timeout)
        _await_exits(procs, outcomes, exit_grace)
        hung = [r for r, o in outcomes.items() if o.status == "hung"]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)  # type: ignore[arg-type]
        if hung:
            time.sleep(1.0)
        ranks = [dataclasses.replace(outcomes[r], output=_tail(logs[r])) for r in range(world_size)]
        _kill(procs, sweep=False)
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
                    outcomes[r] = RankOutcome(r, "died", exitcode=p.exitcode, exited=True)
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

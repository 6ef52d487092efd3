"""Worker pools: N ranks joined by one gloo process group that run many tests' jobs in turn.

Starting ranks is cheap (a forkserver); what a fresh rank pays on its first job is not:
imports made lazily (torch's compiler stack, the test's own module and what it imports),
the process group's connections, first calls into torch. A pool pays them once per world
size, then runs each job in ranks that are already joined. It keeps what
``run_distributed`` promised for fresh ranks, per job:

* a rank that raises, dies or hangs fails the job with the test's name and that rank's
  traceback or stacks (``dist._collect``); the pool is then discarded and the next job gets
  a new one, so a broken pool never runs a second test;
* every rank starts the job as a fresh process would (``isolation.ProcessSnapshot``), and
  after it checks what the job left behind: a finding fails the job that left it (its name
  and the findings), and the pool is discarded;
* each rank's output is cut to the job's own before the job starts.

Pools are kept per (world size, collective timeout): the process group's timeout is fixed
when it is made. ``Pools`` holds them, the least recently used closed beyond a number of
ranks.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.testing import dist as harness
from zerotrain.testing.isolation import ProcessSnapshot, describe

_READY = 0  # the job id of a worker's "joined and ready" report
_START_TIMEOUT_S = 120.0


def _fresh_library_state() -> None:
    """zerotrain's process-wide settings as a new process has them: the communicators of
    ``zerotrain.comm`` (a script's, kept for the process's life) and the activation
    checkpointing settings of ``checkpointing.configure``."""
    from zerotrain.checkpointing import state as checkpointing_state
    from zerotrain.comm import public

    public.forget_communicators()
    checkpointing_state.reset()


def _pool_worker(
    rank: int,
    world_size: int,
    port: int,
    tasks: Any,
    results: Any,
    log_path: str,
    comm_timeout_s: float,
    launcher: int,
) -> None:
    harness.become_rank(rank, world_size, port, log_path, comm_timeout_s, launcher, append=True)
    try:
        harness.join_group(rank, world_size, port, comm_timeout_s)
        _warm_up(comm_timeout_s)
        ready: tuple[str, Any] = ("ok", None)
    except BaseException:
        ready = ("error", traceback.format_exc())
    results.put((_READY, rank, pickle.dumps(ready), time.time()))
    if ready[0] != "ok":
        return
    # After the first report: the queue's feeder thread is the pool's, not a test's.
    snapshot = ProcessSnapshot.take(comm_timeout_s)
    # What exists now (torch, zerotrain, the warm-up's garbage collected) lives as long as
    # the worker: frozen, the collector skips it, and the check's collection after each
    # job takes milliseconds instead of 140 ms.
    gc.collect()
    gc.freeze()
    env: Mapping[str, str] = {}
    while (task := tasks.get()) is not None:
        step, job_id, payload, job_env = task
        if step == "run":
            env = job_env
            outcome = _run_job(snapshot, payload, env)
        else:  # "check": every rank has finished the job
            outcome = _check_job(snapshot, env)
        results.put((job_id, rank, outcome, time.time()))
    dist.destroy_process_group()


def _warm_up(comm_timeout_s: float) -> None:
    """Start what lives as long as the process (the heartbeat thread and its store client),
    so that the snapshot taken next counts it as the resting state."""
    from zerotrain.comm.collectives import Communicator

    if dist.get_world_size() > 1:
        Communicator(timeout=datetime.timedelta(seconds=comm_timeout_s))
    torch.manual_seed(torch.initial_seed())  # the generator as a fresh process has it


def _run_job(snapshot: ProcessSnapshot, payload: bytes, env: Mapping[str, str]) -> bytes:
    sys.stdout.flush()
    sys.stderr.flush()
    os.ftruncate(1, 0)  # the job's output only (stdout and stderr share the log)
    snapshot.prepare(env)
    try:
        fn, args, kwargs = pickle.loads(payload)
        outcome: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    try:
        return pickle.dumps(outcome)
    except Exception:
        return pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))


def _check_job(snapshot: ProcessSnapshot, env: Mapping[str, str]) -> bytes:
    """What the job left behind (run once every rank has finished it: the check's probe
    collective must not wait on a rank still inside the job)."""
    try:
        _fresh_library_state()  # what the library keeps for the process, released first
        findings = snapshot.findings(env)
    except BaseException:
        findings = ["the check for what it left failed:\n" + traceback.format_exc()]
    return pickle.dumps(("left", describe(findings)) if findings else ("ok", None))


class Pool:
    """``world_size`` ranks in one gloo process group, running jobs one at a time.

    Args:
        world_size: ranks in the pool.
        comm_timeout: the process group's timeout (and ``ZEROTRAIN_COMM_TIMEOUT``), seconds.
    """

    def __init__(self, world_size: int, comm_timeout: float) -> None:
        self.world_size = world_size
        self.comm_timeout = comm_timeout
        self.jobs_run = 0
        ctx = harness.context()
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._log_dir = tempfile.mkdtemp(prefix="zerotrain-pool-")
        self.logs = [os.path.join(self._log_dir, f"rank{r}.log") for r in range(world_size)]
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._job_id = _READY
        self.procs: list[BaseProcess] = [
            ctx.Process(
                target=_pool_worker,
                args=(
                    r,
                    world_size,
                    self._store.port,
                    self._tasks[r],
                    self._results,
                    self.logs[r],
                    comm_timeout,
                    os.getpid(),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        self.closed = False
        try:
            for p in self.procs:
                p.start()
            harness.collect(
                self.procs,
                self._receive,
                self.logs,
                world_size,
                _START_TIMEOUT_S,
                f"starting a pool of {world_size} ranks",
            )
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _receive(self, timeout: float) -> tuple[int, bytes, float]:
        """The next report of the current job (reports of an earlier job are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            job, rank, payload, at = self._results.get(
                timeout=max(0.0, deadline - time.monotonic())
            )
            if job == self._job_id:
                return rank, payload, at

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        env: Mapping[str, str],
        timeout: float,
        name: str,
    ) -> list[Any]:
        """Run one job; on any failure the pool is closed and the error raised."""
        if self.closed:
            raise RuntimeError("this pool was closed")
        payload = pickle.dumps((fn, args, kwargs))
        self.jobs_run += 1
        try:
            results = self._step("run", payload, env, timeout, name)
            # A short deadline: the check waits on nothing but itself (its probe collective
            # gives up after the group's timeout; the settling of threads takes seconds).
            self._step("check", b"", env, self.comm_timeout + 30.0, name)
        except BaseException:
            self.close()
            raise
        return results

    def _step(
        self, step: str, payload: bytes, env: Mapping[str, str], timeout: float, name: str
    ) -> list[Any]:
        self._job_id += 1
        for tasks in self._tasks:
            tasks.put((step, self._job_id, payload, dict(env)))
        return harness.collect(self.procs, self._receive, self.logs, self.world_size, timeout, name)

    def close(self) -> None:
        """Stop the ranks (at once: a clean pool has nothing to finish) and remove the logs."""
        if self.closed:
            return
        self.closed = True
        harness.kill(self.procs)
        shutil.rmtree(self._log_dir, ignore_errors=True)
        del self._store


class Pools:
    """The pools of a test session, by (world size, collective timeout); at most
    ``max_ranks`` ranks stay alive (the least recently used pools are closed first)."""

    def __init__(self, max_ranks: int = 12) -> None:
        self.max_ranks = max_ranks
        self._pools: OrderedDict[tuple[int, float], Pool] = OrderedDict()
        self.started = 0

    def get(self, world_size: int, comm_timeout: float) -> Pool:
        key = (world_size, comm_timeout)
        pool = self._pools.pop(key, None)
        if pool is None or pool.closed:
            self._make_room(world_size)
            pool = Pool(world_size, comm_timeout)
            self.started += 1
        self._pools[key] = pool
        return pool

    def _make_room(self, world_size: int) -> None:
        for key in [k for k, p in self._pools.items() if p.closed]:
            del self._pools[key]
        while self._pools and self.live_ranks() + world_size > self.max_ranks:
            _, oldest = self._pools.popitem(last=False)
            oldest.close()

    def live_ranks(self) -> int:
        return sum(p.world_size for p in self._pools.values() if not p.closed)

    def close_all(self) -> None:
        while self._pools:
            _, pool = self._pools.popitem()
            pool.close()


POOLS = Pools()
atexit.register(POOLS.close_all)

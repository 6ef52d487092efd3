"""A rank lost over gloo TCP (``ZEROTRAIN_SHM=0``, what every multi-host job uses) is named
by the survivors, with its host, and no survivor is named with it (issue 42): killed outright
(``/proc`` says it exited), ended by an uncaught exception or by SIGTERM while blocked in a
collective (its exit marker says how), a zombie and a rank stopped with SIGSTOP under plain
torchrun (within the heartbeat timeout).

Found: in a rank started by ``fork`` (this suite's jobs; Python's default start method on
Linux) the heartbeat thread forgot the job's store as soon as it was registered, so after
the gloo error every rank, the survivors included, looked silent ("Rank(s) [1, 2] stopped
answering" on rank 0 when only rank 1 had died).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zerotrain.comm import P2POp, liveness
from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
from zerotrain.testing.dist import run_to_the_end


def _one_rank_killed() -> str:
    comm = Communicator()
    comm.all_reduce(torch.ones(4), purpose="gradients")
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100):
            comm.all_reduce(torch.ones(4), purpose="gradients")
    except CollectiveError as err:
        return str(err)
    return "no error"


def _p2p_peer_killed() -> str:
    comm = Communicator()
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    (handle,) = comm.post_in_order([P2POp.recv(torch.empty(1000), 1, purpose="activations")])
    try:
        handle.wait()
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_a_pipeline_receive_names_the_killed_sender():
    """Point-to-point over TCP (a pipeline's messages to another host): gloo says only that
    the connection closed; the receive's error names the sender and its host."""
    outcome = run_to_the_end(
        _p2p_peer_killed, 2, timeout=60, comm_timeout=20, env={"ZEROTRAIN_SHM": "0"}
    )
    message = str(outcome.ranks[0].value)
    assert f"Rank(s) [1] exited: rank 1 (host {socket.gethostname()}, pid " in message, message


def test_survivors_name_the_killed_rank_and_only_it():
    outcome = run_to_the_end(
        _one_rank_killed, 3, timeout=60, comm_timeout=20, env={"ZEROTRAIN_SHM": "0"}
    )
    assert outcome.ranks[1].status == "died", outcome
    host = socket.gethostname()
    for rank in (0, 2):
        message = str(outcome.ranks[rank].value)
        assert f"Rank(s) [1] exited: rank 1 (host {host}, pid " in message, (rank, message)
        assert "its process exited" in message, (rank, message)
        assert "stopped answering" not in message, (rank, message)


# Ranks started as plain processes (no launcher agent that would end the survivors as soon
# as one rank exits), each printing its pid, then what its failed collective said.
_THREE_RANKS = """
import os, sys, time, torch, zerotrain
import torch.distributed as dist
from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
zerotrain.init_distributed()
comm = Communicator()
comm.all_reduce(torch.ones(4), purpose="warm-up")
rank, scenario = dist.get_rank(), os.environ["SCENARIO"]
print(f"pid {os.getpid()}", flush=True)
if rank == 1 and scenario == "raise":
    raise ValueError("bad batch")
if rank == 2 and scenario == "sigterm":
    time.sleep(6)  # rank 1 waits for it inside gloo (in C) when SIGTERM arrives
try:
    comm.all_reduce(torch.ones(4), purpose="gradients")
    print("no error", flush=True)
except CollectiveError as err:
    print(f"named: {err}", flush=True)
time.sleep(30)  # rank 0 hosts the store, which the others still read; the test ends them
"""


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return {**env, "ZEROTRAIN_SHM": "0", "OMP_NUM_THREADS": "1", **extra}


class _Lines:
    """A process's output lines as they come, with when each came."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend((time.monotonic(), x) for x in proc.stdout),  # type: ignore[union-attr]
            daemon=True,
        )
        self._reader.start()

    def until(self, found: Callable[[str], bool], timeout: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next(((t, x) for t, x in list(self.lines) if found(x)), None)
            if hit is not None:
                return hit
            time.sleep(0.05)
        return None

    def text(self) -> str:
        return "".join(x for _, x in self.lines)


def _three_plain_ranks(tmp_path: Path, scenario: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(_THREE_RANKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_environment(
                SCENARIO=scenario,
                RANK=str(rank),
                WORLD_SIZE="3",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                ZEROTRAIN_COMM_TIMEOUT="60",
            ),
        )
        for rank in range(3)
    ]


def _named_lines(procs: list[subprocess.Popen[str]], lines: list[_Lines]) -> list[str]:
    said = []
    for rank in (0, 2):
        hit = lines[rank].until(lambda x: x.startswith(("named: ", "no error")), 60)
        assert hit is not None, lines[rank].text()
        said.append(hit[1])
    return said


def test_a_rank_that_raised_is_named_with_its_exception(tmp_path):
    procs = _three_plain_ranks(tmp_path, "raise")
    try:
        lines = [_Lines(p) for p in procs]
        said = _named_lines(procs, lines)
    finally:
        for proc in procs:
            proc.kill()
    pid = lines[1].until(lambda x: x.startswith("pid "), 1)
    assert pid is not None, lines[1].text()
    who = f"rank 1 (host {socket.gethostname()}, pid {pid[1].split()[1]})"
    for message in said:
        assert f"Rank(s) [1] exited: {who}: its exit marker says: exited after an uncaught " in (
            message
        ), message
        assert "ValueError: bad batch" in message, message


def test_a_rank_sigtermed_inside_a_collective_ends_at_once_and_is_named(tmp_path):
    """The exit marker is written even though rank 1's main thread is blocked in gloo,
    where Python's own handler would not run: SIGTERM still ends it at once, as it did
    without a handler (killed by the signal, not an exit code)."""
    procs = _three_plain_ranks(tmp_path, "sigterm")
    try:
        lines = [_Lines(p) for p in procs]
        assert lines[1].until(lambda x: x.startswith("pid "), 60), lines[1].text()
        time.sleep(1.0)  # inside the all-reduce, waiting for rank 2
        sent = time.monotonic()
        procs[1].send_signal(signal.SIGTERM)
        code = procs[1].wait(timeout=10)
        ended = time.monotonic() - sent
        said = _named_lines(procs, lines)
    finally:
        for proc in procs:
            proc.kill()
    assert code == -signal.SIGTERM, (code, lines[1].text())
    assert ended < 2.0, ended
    for message in said:
        assert "Rank(s) [1] exited: rank 1 (host " in message, message
        assert "its exit marker says: killed by SIGTERM" in message, message


_STOPPED_UNDER_TORCHRUN = """
import os, signal, time, torch, zerotrain
import torch.distributed as dist
from zerotrain.comm.collectives import Communicator
zerotrain.init_distributed()
comm = Communicator()
comm.all_reduce(torch.ones(4), purpose="warm-up")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
print(f"waiting {time.monotonic()}", flush=True)
comm.all_reduce(torch.ones(4), purpose="gradients")  # rank 1 never comes
"""


def _torchrun(tmp_path: Path, script_text: str) -> subprocess.Popen[str]:
    """Two ranks of ``script_text`` under plain torchrun on this host, over TCP, with a 3 s
    heartbeat timeout and a 120 s collective timeout (which no test may wait out)."""
    script = tmp_path / "job.py"
    script.write_text(script_text)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.Popen(
        [*command, "--nproc-per-node=2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_environment(ZEROTRAIN_HEARTBEAT_TIMEOUT="3", ZEROTRAIN_COMM_TIMEOUT="120"),
        start_new_session=True,
    )


def _end(job: subprocess.Popen[str]) -> None:
    """Kill torchrun and every process under it: its workers run in sessions of their own,
    out of reach of a kill of its process group (found: stopped ranks left behind)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [job.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)


def test_a_stopped_rank_is_named_within_the_heartbeat_timeout_under_plain_torchrun(tmp_path):
    """The peer watchdog is on by default (it was only under ``zerotrain run`` across
    hosts): rank 0, blocked over TCP on a rank stopped with SIGSTOP, exits naming it after
    the heartbeat timeout, not the collective timeout (120 s here)."""
    job = _torchrun(tmp_path, _STOPPED_UNDER_TORCHRUN)
    lines = _Lines(job)
    try:
        named = lines.until(lambda x: "stopped answering" in x, 60)
    finally:
        _end(job)  # the stopped rank included
    output = lines.text()
    assert named is not None, output
    assert "Rank(s) [1] stopped answering (no heartbeat for 3 s" in named[1], output
    waiting = [float(x.split()[1]) for _, x in lines.lines if x.startswith("waiting ")]
    assert waiting, output
    seconds = named[0] - max(waiting)
    print(f"stopped rank named after {seconds:.1f} s (heartbeat timeout 3 s)")
    assert seconds < 3 + 2, output  # the timeout, the watchdog's 1 s polls, a loaded machine


def _slow_peer() -> str:
    comm = Communicator()
    comm.all_reduce(torch.ones(4), purpose="warm-up")
    if comm.rank == 1:
        time.sleep(6)  # alive and ticking, but late: rank 0's collective times out first
        return ""
    try:
        comm.all_reduce(torch.ones(4), purpose="gradients")
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_a_failure_no_heartbeat_explains_says_it_cannot_tell():
    message = (
        run_to_the_end(_slow_peer, 2, timeout=60, comm_timeout=2, env={"ZEROTRAIN_SHM": "0"})
        .ranks[0]
        .value
    )
    assert "cannot be told from here" in str(message), message
    assert "stopped answering" not in str(message), message


_ZOMBIE_UNDER_TORCHRUN = """
import os, time, torch, zerotrain
import torch.distributed as dist
from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
zerotrain.init_distributed()
comm = Communicator()
comm.all_reduce(torch.ones(4), purpose="warm-up")
print(f"pid {dist.get_rank()} {os.getpid()}", flush=True)
if dist.get_rank() == 1:
    time.sleep(120)  # killed here by the test
try:
    comm.all_reduce(torch.ones(4), purpose="gradients")
except CollectiveError as err:
    print(f"named: {err}", flush=True)
time.sleep(120)
"""


def test_a_zombie_rank_is_named_within_the_heartbeat_timeout_under_plain_torchrun(tmp_path):
    """Rank 1 killed while torchrun's agent is stopped, so that nobody reaps it: a zombie
    still has a process id (and had no chance to write an exit marker). Rank 0 names it
    from ``/proc`` as soon as gloo reports the closed connection."""
    job = _torchrun(tmp_path, _ZOMBIE_UNDER_TORCHRUN)
    lines = _Lines(job)
    try:
        # Both ranks write to one pipe: their lines may run together.
        assert lines.until(lambda x: re.search(r"pid 1 \d+\D", x) is not None, 60), lines.text()
        victim = int(re.findall(r"pid 1 (\d+)", lines.text())[0])
        time.sleep(0.5)  # rank 0 is in its all-reduce
        os.kill(job.pid, signal.SIGSTOP)  # the agent: it would reap rank 1, and end rank 0
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        named = lines.until(lambda x: "named: " in x, 30)
        state = liveness.process_state(victim)
    finally:
        _end(job)
    assert state == "a zombie (exited, not reaped)", state
    assert named is not None, lines.text()
    assert (
        f"Rank(s) [1] exited: rank 1 (host {socket.gethostname()}, pid {victim}): " in (named[1])
    ), named[1]
    assert "its process is a zombie (exited, not reaped)" in named[1], named[1]
    seconds = named[0] - killed
    print(f"zombie rank named after {seconds:.1f} s (heartbeat timeout 3 s)")
    assert seconds < 3, lines.text()


_FORKED_CHILD_TERMINATED = """
import datetime, multiprocessing as mp, time
import torch.distributed as dist
from zerotrain.comm import liveness
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
connect = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                timeout=datetime.timedelta(seconds=30))
liveness.start_store_heartbeats(0, connect)  # installs the exit marker's SIGTERM handling
child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
time.sleep(0.5)
child.terminate()  # SIGTERM, as a DataLoader ends a worker that does not stop
child.join(10)
time.sleep(1.0)  # the parent's signal reader would have acted by now
from zerotrain.comm import departures
marked = server.check([f"{departures.EXIT_PREFIX}0"])
print(f"parent alive; child exit code {child.exitcode}; marker {marked}", flush=True)


def child_then_grandchild():
    # The child's own pipe may take the numbers of the wakeup pipe it closed at fork: its
    # child (a worker's pool) must not close them again.
    import os
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.fstat(read_end), os.fstat(write_end)
            os._exit(0)
        except OSError:
            os._exit(3)
    os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


nested = mp.get_context("fork").Process(target=child_then_grandchild)
nested.start()
nested.join(10)
print(f"a grandchild leaves its parent's pipe open: {nested.exitcode == 0}", flush=True)
"""


def test_a_forked_child_ended_by_sigterm_leaves_its_parent_alive(tmp_path):
    """A forked child (a data loader's worker) shares its parent's signal wakeup pipe: its
    SIGTERM must neither end the parent nor write the parent's exit marker; and the child's
    own children must not close descriptors the child opened since."""
    script = tmp_path / "fork.py"
    script.write_text(_FORKED_CHILD_TERMINATED)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(),
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "parent alive; child exit code -15; marker False" in done.stdout, done.stdout
    assert "a grandchild leaves its parent's pipe open: True" in done.stdout, done.stdout

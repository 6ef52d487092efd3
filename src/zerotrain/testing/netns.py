"""Separate network hosts on one machine, for multi-host tests and benchmarks: Linux network
namespaces joined by a switch, each host's link optionally throttled with a token bucket
(``tc qdisc ... tbf``).

Every host is a namespace with its own loopback and one interface to a bridge in a switch
namespace; traffic between hosts crosses that link (and zerotrain's shared-memory transport
never joins ranks of different network namespaces: ``comm.shm.host_identity``). A process
runs on a host through ``ip netns exec``. Needs root; :func:`unavailable` says why not
otherwise, so a test can skip with the reason.

    with hosts(2, rate="100mbit") as (a, b):
        a.popen([sys.executable, "worker.py"], env=...)   # listens on a.address
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@functools.cache
def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    probe = f"ztprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address, and the interface of its link."""

    namespace: str
    address: str
    interface: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def link_bytes(self) -> int:
        """Bytes sent plus received on this host's link so far."""
        total = 0
        for way in ("tx_bytes", "rx_bytes"):
            out = subprocess.run(
                self.command(["cat", f"/sys/class/net/{self.interface}/statistics/{way}"]),
                capture_output=True,
                text=True,
                check=True,
            )
            total += int(out.stdout.strip())
        return total


# Which namespaces each live test process made: a process killed outright (a CI run
# stopped with SIGKILL) never reaches its cleanup, and the next ``hosts()`` removes what it
# left, with every process still inside.
RECORDS = Path("/run/zerotrain-netns")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(name: str) -> None:
    """End every process in namespace ``name``, then delete it (with its interfaces)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    if pids:
        subprocess.run(["kill", "-9", *pids], capture_output=True, check=False)
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces of test processes that are gone; returns their names."""
    removed: list[str] = []
    if not RECORDS.is_dir():
        return removed
    for record in RECORDS.iterdir():
        owner, _, names = record.read_text().partition("\n")
        if owner.strip().isdigit() and _alive(int(owner)):
            continue
        for name in names.split():
            _remove(name)
            removed.append(name)
        record.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def hosts(count: int, rate: str | None = None) -> Iterator[list[Host]]:
    """``count`` hosts on one switch (each link throttled to ``rate``, e.g. "100mbit", in
    both directions); on exit every process still in a host is killed and every namespace
    and link removed.

    Raises:
        RuntimeError: namespaces are unavailable (see :func:`unavailable`), or a command
            failed (its message is included).
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    sweep_stale()
    tag = f"zt{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    switch = f"{tag}sw"
    made: list[str] = []
    RECORDS.mkdir(parents=True, exist_ok=True)
    record = RECORDS / f"{tag}-{time.monotonic_ns()}"
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        record.write_text(f"{os.getpid()}\n{switch}\n")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        found = []
        for i in range(count):
            name, inner, outer = f"{tag}h{i}", f"{tag}h{i}", f"{tag}p{i}"
            _ip("netns", "add", name)
            made.append(name)
            record.write_text(f"{os.getpid()}\n" + "\n".join(made) + "\n")
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", name)
            _ip("link", "set", outer, "netns", switch)
            _ip("-n", switch, "link", "set", outer, "master", "br0")
            _ip("-n", switch, "link", "set", outer, "up")
            address = f"{subnet}.{i + 1}"
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if rate is not None:
                for space, device in ((name, inner), (switch, outer)):
                    _throttle(space, device, rate)
            found.append(Host(name, address, inner))
        yield found
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"setting up network namespaces failed: {err.stderr.strip()}") from err
    finally:
        for name in reversed(made):
            _remove(name)  # processes outlive a deleted namespace: they are ended first
        record.unlink(missing_ok=True)


def _throttle(namespace: str, device: str, rate: str) -> None:
    """A token bucket on ``device``'s egress: ``rate``, bursts of 128 KiB, at most 50 ms of
    queue (more is dropped, as a congested link drops)."""
    subprocess.run(
        [
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", rate, "burst", "128kb", "latency", "50ms",
        ],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip


class Place(Protocol):
    """Where one rank runs: an address others reach it at, the interface gloo binds, and
    how a command starts there."""

    @property
    def address(self) -> str: ...

    @property
    def interface(self) -> str: ...

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]: ...


@dataclass(frozen=True)
class Local:
    """This machine's loopback, the process optionally in new namespaces of its own
    (``unshare`` options, e.g. ``("--pid", "--fork", "--mount-proc")``: a rank in another
    PID namespace). A shell stays in front of the process, so that it is not its
    namespace's init (which ignores signals it sent itself, SIGSTOP included)."""

    unshare: tuple[str, ...] = ()
    address: str = "127.0.0.1"
    interface: str = "lo"

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` here (in its own namespaces when asked)."""
        if not self.unshare:
            return subprocess.Popen(list(argv), **kwargs)
        script = " ".join(shlex.quote(a) for a in argv) + "; exit $?"
        return subprocess.Popen(["unshare", *self.unshare, "sh", "-c", script], **kwargs)


class Job:
    """One job launched with rank r at ``placement[r]``, rendezvousing at the first place's
    address with ``env://``; each rank runs ``fn(*args)`` (module-level, as for
    ``run_distributed``) through ``zerotrain.testing.host_worker``. A context manager: on
    exit every rank still running is killed and the files are removed."""

    def __init__(
        self,
        fn: Callable[..., Any],
        placement: Sequence[Place],
        *args: Any,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._tmp = tempfile.TemporaryDirectory(prefix="zerotrain-hosts-")
        tmp = Path(self._tmp.name)
        call = tmp / "call.pkl"
        call.write_bytes(pickle.dumps((fn, args)))
        port = str(_free_port())
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[Any] = []
        self.results = [tmp / f"rank{r}.pkl" for r in range(len(placement))]
        for rank, place in enumerate(placement):
            rank_env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "RANK": str(rank),
                "WORLD_SIZE": str(len(placement)),
                "LOCAL_RANK": str(sum(p == place for p in placement[:rank])),
                "MASTER_ADDR": placement[0].address,
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                "ZEROTRAIN_DEVICE": "cpu",
                # gloo picks its interface from the host name otherwise, which resolves to
                # an address a namespace host does not have.
                "GLOO_SOCKET_IFNAME": place.interface,
                **(env or {}),
            }
            log = open(tmp / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed in close())
            self.logs.append(log)
            argv = [sys.executable, "-m", "zerotrain.testing.host_worker", str(call)]
            argv.append(str(self.results[rank]))
            self.procs.append(place.popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT))

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, ranks: Sequence[int], timeout: float) -> None:
        """Wait for ``ranks`` to end. Raises RuntimeError (with every rank's output) if they
        have not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            for rank in ranks:
                self.procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{self.name}: not finished within {timeout:.0f} s\n{self.outputs()}"
            ) from None

    def result(self, rank: int) -> tuple[str, Any]:
        """``("ok", value)``, ``("error", traceback)`` or ``("missing", None)``."""
        path = self.results[rank]
        if not path.exists():
            return "missing", None
        status, value = pickle.loads(path.read_bytes())
        return str(status), value

    def outputs(self) -> str:
        """Every rank's output (its last 3000 characters)."""
        parts = []
        for rank, log in enumerate(self.logs):
            log.flush()
            log.seek(0)
            parts.append(f"--- rank {rank} output ---\n{log.read()[-3000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """Kill what still runs (a stopped rank too), then remove the files."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        self._tmp.cleanup()


def _own_group(proc: subprocess.Popen[Any]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def run_on_hosts(
    fn: Callable[..., Any],
    placement: Sequence[Place],
    *args: Any,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` as one :class:`Job` across ``placement``; returns each rank's
    result.

    Raises:
        RuntimeError: a rank failed (its traceback and output are in the message) or the
            job did not finish within ``timeout`` seconds.
    """
    with Job(fn, placement, *args, env=env) as job:
        job.wait(range(len(placement)), timeout)
        results = []
        for rank in range(len(placement)):
            status, value = job.result(rank)
            if status != "ok":
                raise RuntimeError(f"rank {rank} {status}:\n{value}\n{job.outputs()}")
            results.append(value)
        return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ssh_unavailable() -> str | None:
    """Why :func:`ssh_servers` cannot run here (None: it can)."""
    for tool in ("/usr/sbin/sshd", shutil.which("ssh"), shutil.which("ssh-keygen")):
        if tool is None or not Path(tool).exists():
            return "OpenSSH (server and client) is not installed (apt-get install openssh-server)"
    return unavailable()


@contextlib.contextmanager
def ssh_servers(hosts_: Sequence[Host], folder: Path) -> Iterator[str]:
    """An sshd on every host, accepting a key made for the occasion; yields the ``ssh``
    command (with that key and no host-key prompts) that reaches them. The servers are
    stopped on exit."""
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    host_key = folder / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    (folder / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    servers = []
    try:
        for host in hosts_:
            config = folder / f"sshd_{host.namespace}.conf"
            config.write_text(
                f"ListenAddress {host.address}\nPort 22\nHostKey {host_key}\n"
                f"AuthorizedKeysFile {folder}/authorized_keys\nPidFile none\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "UsePAM no\nStrictModes no\nAcceptEnv none\n"
            )
            servers.append(
                host.popen(
                    ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for host in hosts_:  # wait until each listens
            deadline = time.monotonic() + 10
            while subprocess.run(
                host.command(["bash", "-c", f"exec 3<>/dev/tcp/{host.address}/22"]),
                capture_output=True,
            ).returncode:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host.namespace} did not start")
                time.sleep(0.1)
        yield (
            f"ssh -i {key} -o BatchMode=yes -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        )
    finally:
        for server in servers:
            server.kill()
            server.wait()

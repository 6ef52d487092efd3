"""Process-group set-up from the environment torchrun exports (or a single process without one).

The device and backend are chosen together: ``cuda`` + ``nccl`` when CUDA is available,
otherwise ``cpu`` + ``gloo``. ``ZEROTRAIN_DEVICE=cpu`` forces the CPU path on a GPU machine;
asking for CUDA where there is none is an error, never a silent fallback.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerotrain.comm import liveness
from zerotrain.comm.interface import choose_gloo_interface
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

DEFAULT_TIMEOUT_S = 600.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Where this process sits in the job and what it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta


def default_timeout() -> datetime.timedelta:
    """Collective timeout: ``ZEROTRAIN_COMM_TIMEOUT`` seconds, else 600 s."""
    raw = os.environ.get("ZEROTRAIN_COMM_TIMEOUT")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(
            f"ZEROTRAIN_COMM_TIMEOUT must be a number of seconds, got {raw!r}"
        ) from None
    if seconds <= 0:
        raise ValueError(f"ZEROTRAIN_COMM_TIMEOUT must be > 0, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def select_device(local_rank: int) -> tuple[torch.device, str]:
    """Pick ``(device, backend)`` for this rank. Raises if a requested device is unavailable."""
    wanted = os.environ.get("ZEROTRAIN_DEVICE", "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROTRAIN_DEVICE must be 'cpu' or 'cuda', got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ZEROTRAIN_DEVICE=cuda, but torch sees no CUDA device on this machine")
    use_cuda = wanted == "cuda" or (wanted == "" and torch.cuda.is_available())
    if use_cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this node has {count} visible CUDA "
                "device(s); launch at most that many processes per node"
            )
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(
            f"environment variable {name} must be an integer, got {value!r}"
        ) from None


def _env_from_group(timeout: datetime.timedelta) -> DistEnv:
    local_rank = _env_int("LOCAL_RANK", 0)
    device, expected_backend = select_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = str(dist.get_backend())
    if expected_backend not in backend:
        raise RuntimeError(
            f"the existing process group uses backend '{backend}', but tensors live on "
            f"{device.type}, which needs '{expected_backend}'"
        )
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, timeout)
    _start_heartbeats(env)
    return env


def rendezvous_timeout() -> float:
    """Seconds a rank waits for the job's store at start-up: ``ZEROTRAIN_RENDEZVOUS_TIMEOUT``,
    else 120."""
    raw = os.environ.get("ZEROTRAIN_RENDEZVOUS_TIMEOUT")
    try:
        seconds = float(raw) if raw else 120.0
    except ValueError:
        raise ValueError(
            f"ZEROTRAIN_RENDEZVOUS_TIMEOUT must be a number of seconds, got {raw!r}"
        ) from None
    if seconds <= 0:
        raise ValueError(f"ZEROTRAIN_RENDEZVOUS_TIMEOUT must be > 0, got {seconds}")
    return seconds


def _check_rendezvous() -> None:
    """Before an ``env://`` rendezvous (not torchrun's agent store, which owns its port):
    rank 0 checks that MASTER_PORT is free, and every other rank that a zerotrain store
    answers there within ``rendezvous_timeout()``. Otherwise a port held by another program
    fails rank 0 at once and leaves the others waiting for the collective timeout.

    Raises:
        RuntimeError: naming the address and port, and what to do.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    wait = rendezvous_timeout()
    where = f"{addr}:{port}"
    if int(os.environ["RANK"]) == 0:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As the store sets it: a port left in TIME_WAIT by an earlier run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise RuntimeError(
                f"rank 0: cannot host the job's rendezvous store on {where}: {exc.strerror} "
                "(another program holds the port); set MASTER_PORT to a free port on every rank"
            ) from exc
        finally:
            probe.close()
        return
    # The store client's own timeout does not bound its handshake with a server that
    # accepts and never answers: the probe runs on a thread the deadline abandons.
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=wait))
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="zerotrain-rendezvous-probe", daemon=True)
    thread.start()
    thread.join(wait)
    if outcome and outcome[0] is None:
        return
    cause = f" ({outcome[0]})" if outcome else ""
    raise RuntimeError(
        f"rank {os.environ['RANK']}: no rendezvous store answered on {where} within "
        f"{wait:g} s (ZEROTRAIN_RENDEZVOUS_TIMEOUT): rank 0 did not start one there (see "
        f"its error: the port may be held by another program, or MASTER_ADDR is wrong)"
        f"{cause}"
    )


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        # The group object can survive in a reference cycle; collecting it now runs its
        # destructor, which joins gloo's worker threads while Python can still serve them.
        gc.collect()


DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
_BACKENDS = ("gloo", "nccl")
# MPI launchers' variables for rank, size and local rank (Open MPI, then PMI/PMIx).
_MPI_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMIX_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _backend_for(device: torch.device, wanted: str | None) -> str:
    """The backend to use on ``device``: ``wanted`` if it can move its tensors."""
    natural = "nccl" if device.type == "cuda" else "gloo"
    if wanted is None:
        return natural
    if wanted not in _BACKENDS:
        raise ValueError(
            f"dist_backend {wanted!r} is not supported; zerotrain runs on {' or '.join(_BACKENDS)}"
        )
    if wanted == "nccl" and device.type != "cuda":
        raise ValueError(
            "dist_backend 'nccl' needs CUDA tensors, but this rank computes on the CPU "
            "(no GPU, or ZEROTRAIN_DEVICE=cpu); use 'gloo' or leave dist_backend unset"
        )
    return wanted


def _mpi_discovery(port: int) -> bool:
    """Fill torchrun's variables from an MPI launcher's (``mpirun`` without torchrun), as
    DeepSpeed's MPI discovery does; returns whether it did. DeepSpeed learned rank 0's host
    through mpi4py; zerotrain needs MASTER_ADDR set for a job of several ranks."""
    found = next((v for v in _MPI_VARS if v[0] in os.environ and v[1] in os.environ), None)
    if found is None:
        return False
    rank_var, size_var, local_var = found
    size = _env_int(size_var)
    if "MASTER_ADDR" not in os.environ:
        if size > 1:
            raise RuntimeError(
                f"launched by MPI ({rank_var}={os.environ[rank_var]}, {size_var}={size}) "
                "without MASTER_ADDR: set MASTER_ADDR (rank 0's host) and MASTER_PORT on every "
                "rank, e.g. mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=29500"
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["RANK"] = os.environ[rank_var]
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["LOCAL_RANK"] = os.environ.get(local_var, "0")
    log.info(
        "MPI discovery: rank %s of %d (local %s), rendezvous %s:%s",
        os.environ["RANK"],
        size,
        os.environ["LOCAL_RANK"],
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    return True


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> DistEnv:
    """Join the job's process group, creating it if needed (DeepSpeed's
    ``deepspeed.init_distributed`` arguments; ``zerotrain.init_distributed`` adds its
    ``config``).

    With torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set, all ranks
    rendezvous through them; under ``mpirun`` (and ``auto_mpi_discovery``) they are filled
    from the MPI launcher's; with ``init_method`` (``tcp://host:port``, ``file://...``) and
    ``rank``/``world_size`` the group is created from those; with none of these, a
    one-process group is created so the same code runs unchanged on a laptop (DeepSpeed
    would fail). A group that already exists is reused.

    Args:
        dist_backend: ``gloo`` or ``nccl``; default: ``nccl`` on CUDA, ``gloo`` on the CPU.
        auto_mpi_discovery: read rank and size from an MPI launcher's variables.
        distributed_port: the rendezvous port when MASTER_PORT is not set (MPI launch).
        verbose: log the set-up at info level (else debug).
        timeout: seconds (or a timedelta) a collective may wait for the other ranks before
            failing; default ``ZEROTRAIN_COMM_TIMEOUT`` or 600 s.
        init_method: a torch.distributed URL; default ``env://``.
        dist_init_required: False: a group must already exist (raise otherwise); True or
            None: create one if none exists.
        rank, world_size: this process's rank and the job's size (with ``init_method``, or
            instead of RANK/WORLD_SIZE).

    Raises:
        RuntimeError: when only some of torchrun's variables are set, no group exists with
            ``dist_init_required=False``, or the device asked for is missing.
        ValueError: a backend zerotrain does not run on, or one the device cannot use.
    """
    timeout = _as_timedelta(timeout)
    report = log.info if verbose else log.debug
    if dist.is_initialized():
        if dist_init_required:
            report("init_distributed: the process group already exists; reusing it")
        return _env_from_group(timeout)
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False): no process group exists yet; pass "
            "dist_init_required=True (or leave it None) or create the group first"
        )
    explicit = init_method is not None or (rank >= 0 and world_size > 0)
    if not explicit and auto_mpi_discovery and "RANK" not in os.environ:
        _mpi_discovery(distributed_port)
    local_rank = _env_int("LOCAL_RANK", 0)
    device, _ = select_device(local_rank)
    backend = _backend_for(device, dist_backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if explicit:
        if rank < 0 or world_size <= 0:
            rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    else:
        present = [v for v in _TORCHRUN_VARS if v in os.environ]
        if present and len(present) != len(_TORCHRUN_VARS):
            missing = sorted(set(_TORCHRUN_VARS) - set(present))
            raise RuntimeError(
                f"incomplete distributed environment: {', '.join(present)} set but "
                f"{', '.join(missing)} missing; launch with `zerotrain run` or torchrun"
            )
        if present:
            _check_rendezvous()
            if backend == "gloo" and (chosen := choose_gloo_interface()) is not None:
                report("gloo binds interface %s (the route to MASTER_ADDR)", chosen)
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    # Destroy the group we created before the interpreter finalises: otherwise gloo's worker
    # threads may release their last tensors after Python stopped handing out the GIL, and
    # the process aborts ("terminate called without an active exception").
    atexit.register(_destroy_at_exit)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, timeout)
    report("process group: %d rank(s), backend %s, device %s", env.world_size, backend, device)
    _start_heartbeats(env)
    return env


def _start_heartbeats(env: DistEnv) -> None:
    """Tick this rank's heartbeat in the job's store (collective failures then name the
    ranks that stopped answering)."""
    if env.world_size > 1:
        liveness.start_store_heartbeats(env.rank, lambda: liveness.store_client(env.timeout))
        silence = liveness.peer_timeout()
        # Only where the job's store is known (torchrun's variables): explicit init
        # methods give no store to read heartbeats from.
        if silence is not None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            short = datetime.timedelta(seconds=min(silence, 10.0))
            # NCCL: the host never waits inside zerotrain (the device does), so the
            # watchdog reads the heartbeats all along, not only during a blocked wait.
            liveness.start_peer_watchdog(
                env.rank,
                env.world_size,
                lambda: liveness.store_client(short),
                silence,
                only_while_waiting=env.backend != "nccl",
            )


def current_rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process in the default process group, or ``(0, 1)``
    when there is none, so that code which places work by rank (a pipeline stage building
    its layers) runs unchanged in one process without a group.

    Raises:
        RuntimeError: a launcher started several processes (``WORLD_SIZE`` > 1) but the
            process group is not set up yet: the answer would be wrong.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"this process is one of WORLD_SIZE={launched}, but the process group is not set "
            "up yet: call zerotrain.init_distributed() first (DeepSpeed: "
            "deepspeed.init_distributed()), e.g. before building a PipelineModule"
        )
    return 0, 1

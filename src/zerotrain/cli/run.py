"""``zerotrain run``: launch a training script on N processes (per node) through torchrun.

torchrun (``torch.distributed.run``) does the real work: rendezvous, worker monitoring,
restarts, multi-node. This module adds the DeepSpeed hostfile, sensible defaults (one
process per GPU, or ``-n`` on CPU with OMP threads split between ranks), and a bootstrap
that records a failing rank's traceback so torchrun's summary shows it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotrain.cli.fanout import fan_out, node_commands, print_commands
from zerotrain.cli.hostfile import Host, HostfileError, read_hostfile, select_hosts, this_node_rank

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    """What torchrun is asked to do, and the environment the ranks get."""

    torchrun_args: list[str]
    env: dict[str, str]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zerotrain run``."""
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--num_gpus",
        "--num-gpus",
        dest="nproc_per_node",
        type=int,
        default=None,
        help="processes per node (default: GPUs on this node, else 1; with a hostfile: its "
        "slots, of which this many are used)",
    )
    parser.add_argument(
        "--hostfile",
        "-H",
        help="DeepSpeed hostfile: one 'hostname slots=N' per line; with several hosts the job "
        "is started on each over ssh (unless --no_ssh)",
    )
    parser.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX (elastic)")
    parser.add_argument(
        "--num_nodes", "--num-nodes", type=int, default=None, help="use the first N hosts"
    )
    parser.add_argument(
        "--include", default=None, help="hosts (and slots) to use: 'worker-0@worker-1:0,2'"
    )
    parser.add_argument("--exclude", default=None, help="hosts (or slots) to leave out")
    parser.add_argument(
        "--node-rank", "--node_rank", type=int, default=None, help="this node's index"
    )
    parser.add_argument(
        "--master-addr", "--master_addr", default=None, help="address of node 0 (rendezvous)"
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="rendezvous port on node 0",
    )
    parser.add_argument(
        "--local-addr",
        default=None,
        help="this node's address as the others reach it (default: its host name)",
    )
    parser.add_argument(
        "--no_ssh",
        "--no-ssh",
        action="store_true",
        help="run only this node's part (each node runs the same command; its rank comes "
        "from the hostfile or --node-rank)",
    )
    parser.add_argument(
        "--ssh-command",
        default="ssh -o BatchMode=yes",
        help="how a host is reached (the host name and command are appended)",
    )
    parser.add_argument(
        "--print-commands",
        action="store_true",
        help="print the Slurm line and each node's command instead of launching",
    )
    parser.add_argument("--rdzv-backend", default=None, help="torchrun rendezvous backend")
    parser.add_argument("--rdzv-endpoint", default=None, help="torchrun rendezvous endpoint")
    parser.add_argument("--rdzv-id", default="zerotrain", help="job id shared by all nodes")
    parser.add_argument(
        "--rdzv-conf",
        default="",
        help="torchrun's rendezvous settings, e.g. 'last_call_timeout=5,join_timeout=120'",
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="worker-group restarts")
    parser.add_argument(
        "--node-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="multi-host: once the job is over (a node failed; elastic: node 0 ended), how "
        "long the other nodes may take to end before their ssh sessions are stopped "
        "(default 30; a host cut off from the network never ends by itself)",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="treat the target as a module name (like python -m)",
    )
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")


def _node_layout(
    args: argparse.Namespace,
) -> tuple[int | None, str | None, int | None, str | None]:
    """``(nproc, nnodes, node_rank, master_addr)`` from the options and the hostfile."""
    nproc, nnodes, node_rank, master_addr = (
        args.nproc_per_node,
        args.nnodes,
        args.node_rank,
        args.master_addr,
    )
    if not args.hostfile:
        return nproc, nnodes, node_rank, master_addr
    hosts = selected_hosts(args)
    host_slots = hosts[0].slots
    if len(hosts) == 1:
        return host_slots, nnodes, node_rank, master_addr
    if node_rank is None:
        node_rank = this_node_rank(hosts)
    if not 0 <= node_rank < len(hosts):
        raise HostfileError(
            f"--node-rank {node_rank} is not a node of the job (0..{len(hosts) - 1}: "
            f"{', '.join(h.name for h in hosts)})"
        )
    return host_slots, nnodes or str(len(hosts)), node_rank, master_addr or hosts[0].name


def selected_hosts(args: argparse.Namespace) -> list[Host]:
    """The hostfile's hosts after ``--include``/``--exclude``/``--num_nodes``/``-n``."""
    hosts = select_hosts(
        read_hostfile(args.hostfile),
        args.include,
        args.exclude,
        args.num_nodes,
        args.nproc_per_node,
    )
    if len({h.slots for h in hosts}) != 1:
        raise HostfileError(
            f"{args.hostfile}: torchrun runs the same number of processes on every node, "
            f"but slots differ ({', '.join(f'{h.name}={h.slots}' for h in hosts)})"
        )
    return hosts


def local_launch(
    nproc: int | None, script: str, script_args: list[str], module: bool, rdzv_id: str
) -> argparse.Namespace:
    """``zerotrain run`` options for a job on this node only (what ``demo`` and
    ``lr-find`` launch): no hostfile, no rendezvous options, no restarts."""
    return argparse.Namespace(
        nproc_per_node=nproc,
        hostfile=None,
        nnodes=None,
        node_rank=None,
        master_addr=None,
        master_port=None,
        rdzv_backend=None,
        rdzv_endpoint=None,
        rdzv_id=rdzv_id,
        max_restarts=0,
        rdzv_conf="",
        num_nodes=None,
        include=None,
        exclude=None,
        local_addr=None,
        no_ssh=True,
        ssh_command="ssh",
        print_commands=False,
        module=module,
        script=script,
        script_args=script_args,
    )


def plan_launch(
    args: argparse.Namespace,
    environ: dict[str, str] | None = None,
    cuda_available: bool | None = None,
) -> LaunchPlan:
    """Translate ``zerotrain run`` options into torchrun arguments and environment.

    torchrun starts the processes of one node; a multi-node job runs the same command on
    every node (each finds its rank in the hostfile, or takes ``--node-rank``).

    Raises:
        HostfileError / ValueError: inconsistent options, with what to change.
    """
    environ = dict(os.environ if environ is None else environ)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    nproc, nnodes, node_rank, master_addr = _node_layout(args)
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else 1
    if nproc < 1:
        raise ValueError(f"-n must be >= 1, got {nproc}")

    env: dict[str, str] = {}
    torchrun = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}"]
    if nnodes not in (None, "1") or master_addr or args.rdzv_endpoint:
        if not (master_addr or args.rdzv_endpoint):
            raise ValueError(
                f"--nnodes {nnodes} needs the address of node 0: pass --master-addr, "
                "--rdzv-endpoint or a --hostfile"
            )
        endpoint = args.rdzv_endpoint or f"{master_addr}:{args.master_port or DEFAULT_PORT}"
        torchrun += [
            f"--nnodes={nnodes or 1}",
            f"--rdzv-backend={args.rdzv_backend or 'c10d'}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]
        if "ZEROTRAIN_PEER_TIMEOUT" not in environ:
            # A host that vanishes without a TCP reset is noticed after a minute of silence
            # instead of the collective timeout (comm/liveness.py: PeerWatchdog).
            env["ZEROTRAIN_PEER_TIMEOUT"] = "60"
        if node_rank is not None:
            torchrun.append(f"--node-rank={node_rank}")
        # Whether this node hosts the rendezvous store, said outright where this node's
        # address is known: torchrun guesses it from host names otherwise, which fails
        # where a host has several addresses (it then finds no store host).
        # Only a match is said: names and addresses of one host may differ (a hostfile name
        # and an IP), where torchrun's own guess still finds the store host.
        here = args.local_addr
        if here is None and args.hostfile and node_rank is not None:
            here = selected_hosts(args)[node_rank].name
        conf = [args.rdzv_conf]
        if here is not None and endpoint.rsplit(":", 1)[0] == here:
            conf.insert(0, "is_host=1")
        if any(conf):
            torchrun.append(f"--rdzv-conf={','.join(filter(None, conf))}")
        if args.local_addr:
            torchrun.append(f"--local-addr={args.local_addr}")
    elif args.master_port:
        torchrun += ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={args.master_port}"]
    else:
        torchrun.append("--standalone")  # single node: torchrun picks a free port itself

    if args.max_restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        # A restarted worker group must not share the rendezvous store with the group it
        # replaces: its ranks could read the dead group's addresses from it and fail to
        # connect (pytorch/pytorch#135712). A fresh store per round avoids that.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "OMP_NUM_THREADS" not in environ and not cuda:
        # CPU ranks share the cores; oversubscribed OpenMP pools slow everyone down.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    target = [
        "-m",
        "zerotrain.cli.bootstrap",
        "--module" if args.module else "--script",
        args.script,
    ]
    return LaunchPlan(torchrun + target + list(args.script_args), env)


def run(args: argparse.Namespace) -> int:
    """Launch and wait. Returns the exit code (non-zero if any rank failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    try:
        hosts = selected_hosts(args) if args.hostfile else []
        if len(hosts) > 1 and (args.print_commands or not args.no_ssh):
            addr = args.master_addr or hosts[0].name
            port = args.master_port or DEFAULT_PORT
            if args.print_commands:
                print_commands(args, hosts, addr, port)
                return 0
            elastic = args.nnodes is not None and ":" in str(args.nnodes)
            if args.node_grace < 0:
                raise ValueError(f"--node-grace must be >= 0 seconds, got {args.node_grace}")
            nodes = node_commands(args, hosts, addr, port)
            return fan_out(nodes, elastic=elastic, grace=args.node_grace)
        plan = plan_launch(args)
    except (HostfileError, ValueError) as err:
        print(f"zerotrain run: {err}", file=sys.stderr)
        return 2
    if args.print_commands:
        assigned = [f"{k}={v}" for k, v in sorted(plan.env.items())]
        command = [sys.executable, "-m", "torch.distributed.run", *plan.torchrun_args]
        print(shlex.join(["env", *assigned, *command] if assigned else command))
        return 0
    os.environ.update(plan.env)
    try:
        with _swap_directories_removed_at_the_end():
            torchrun(get_args_parser().parse_args(plan.torchrun_args))
    except ChildFailedError as err:
        print(err, file=sys.stderr)  # torchrun's table, with each recorded traceback
        rank, failure = root_cause(err.failures)
        print(
            f"zerotrain run: job failed; rank {rank} failed first (exit code "
            f"{failure.exitcode}), {len(err.failures)} rank(s) exited with errors",
            file=sys.stderr,
        )
        return 1
    return 0


@contextlib.contextmanager
def _swap_directories_removed_at_the_end() -> Iterator[None]:
    """The ranks note their NVMe swap directories in a registry of this launcher's; when
    they have ended, however they ended (a rank killed outright cannot clean up), the
    directories left are removed (``offload/swap.py``)."""
    from zerotrain.offload.swap import REGISTRY_ENV, remove_registered_swap_directories

    with tempfile.TemporaryDirectory(prefix="zerotrain-run-swaps-") as registry:
        os.environ[REGISTRY_ENV] = registry
        try:
            yield
        finally:
            del os.environ[REGISTRY_ENV]
            for path in remove_registered_swap_directories(Path(registry)):
                print(f"zerotrain run: removed {path}, left by a rank that ended", file=sys.stderr)


# Failures that are consequences of another rank's failure, not causes.
_COLLATERAL = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Another rank probably exited",
    "Signal 15 (SIGTERM)",
)


def root_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that most likely caused the others.

    When one rank raises, its peers fail moments later in their next collective (or are
    stopped by torchrun), often within the same second, so timestamps alone cannot tell
    cause from effect. A failure whose message is not a lost-peer error is the cause.
    """
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    for rank, failure in ordered:
        if not any(marker in str(failure.message) for marker in _COLLATERAL):
            return rank, failure
    return ordered[0]

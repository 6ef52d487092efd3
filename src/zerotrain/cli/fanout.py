"""``zerotrain run --hostfile H`` across hosts from one command: the per-node commands,
started over ssh (pdsh-style), or printed for a scheduler (``--print-commands``).

Each node runs ``zerotrain run --no_ssh`` with its node rank, the rendezvous address and its
own address (``--local-addr``: what the other nodes reach it by, also where the rendezvous
store listens on node 0); torchrun then starts that node's ranks. The launcher streams every
node's output with its host name in front, waits for all, and exits non-zero if any node
failed, with each failing node's last lines (its ranks' tracebacks) in the summary. A node
that fails ends the job on the others too: their ranks' next collective fails, or their
rendezvous does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from zerotrain.cli.hostfile import Host

# Variables a remote node gets from the launching shell (DeepSpeed exports a similar set,
# plus the lines of a .deepspeed_env file, which is read too).
_EXPORTED_PREFIXES = ("ZEROTRAIN_", "NCCL_", "GLOO_", "OMP_", "PYTHON")
_ENV_FILES = (".zerotrain_env", ".deepspeed_env")
TAIL_LINES = 40


@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: ``argv`` there (its ``zerotrain run``), and the whole remote
    command line (``remote``) when started over ssh."""

    host: str
    node_rank: int
    argv: list[str]
    remote: list[str]


def exported_env(environ: dict[str, str], cwd: str) -> dict[str, str]:
    """The variables every node's command sets: ``.zerotrain_env`` / ``.deepspeed_env`` lines
    (``KEY=VALUE``, in the working directory or the home directory), then the launching
    shell's variables with the prefixes above."""
    env: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), cwd):
        for name in _ENV_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path) as file:
                    for line in file:
                        key, sep, value = line.strip().partition("=")
                        if sep and key and not key.startswith("#"):
                            env[key] = value
    env.update({k: v for k, v in environ.items() if k.startswith(_EXPORTED_PREFIXES)})
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launching host's interface; each node picks
    return env


def node_commands(
    args: argparse.Namespace,
    hosts: list[Host],
    master_addr: str,
    master_port: int,
    environ: dict[str, str] | None = None,
) -> list[NodeCommand]:
    """The command of every node of ``hosts`` (node 0 hosts the rendezvous)."""
    environ = dict(os.environ if environ is None else environ)
    cwd = os.getcwd()
    env = exported_env(environ, cwd)
    commands = []
    for rank, host in enumerate(hosts):
        node_env = dict(env)
        if host.slot_ids is not None:  # --include/--exclude chose these local devices
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.slot_ids))
        argv = [
            sys.executable, "-m", "zerotrain.cli.main", "run", "--no_ssh",
            f"--nproc-per-node={host.slots}",
            f"--nnodes={args.nnodes or len(hosts)}",
            f"--node-rank={rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            f"--local-addr={host.name}",
            f"--rdzv-id={args.rdzv_id}",
            f"--max-restarts={args.max_restarts}",
        ]  # fmt: skip
        if args.rdzv_conf:
            argv.append(f"--rdzv-conf={args.rdzv_conf}")
        if args.rdzv_backend:
            argv.append(f"--rdzv-backend={args.rdzv_backend}")
        if args.rdzv_endpoint:
            argv.append(f"--rdzv-endpoint={args.rdzv_endpoint}")
        if args.module:
            argv.append("-m")
        argv += [args.script, *args.script_args]
        line = " ".join(
            [f"cd {shlex.quote(cwd)} &&", "env"]
            + [f"{k}={shlex.quote(v)}" for k, v in sorted(node_env.items())]
            + [shlex.quote(a) for a in argv]
        )
        remote = [*shlex.split(args.ssh_command), host.name, line]
        commands.append(NodeCommand(host.name, rank, argv, remote))
    return commands


def slurm_command(args: argparse.Namespace, hosts: list[Host], master_port: int) -> str:
    """One ``srun`` line starting the job on a Slurm allocation of these hosts: one task
    per node, each a ``zerotrain run`` that takes its node rank from ``SLURM_NODEID`` and
    the rendezvous host from the first node of the allocation."""
    inner = (
        "zerotrain run --no_ssh --nproc-per-node={slots} --nnodes={nodes} "
        '--node-rank="$SLURM_NODEID" '
        '--master-addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" '
        "--master-port={port} --rdzv-id={rdzv} --max-restarts={restarts} {module}{script}"
    ).format(
        slots=hosts[0].slots,
        nodes=args.nnodes or len(hosts),
        port=master_port,
        rdzv=shlex.quote(args.rdzv_id),
        restarts=args.max_restarts,
        module="-m " if args.module else "",
        script=" ".join(shlex.quote(a) for a in [args.script, *args.script_args]),
    )
    nodelist = ",".join(h.name for h in hosts)
    return (
        f"srun --nodes={len(hosts)} --ntasks-per-node=1 --nodelist={nodelist} "
        f"bash -c {shlex.quote(inner)}"
    )


def print_commands(
    args: argparse.Namespace, hosts: list[Host], master_addr: str, master_port: int
) -> None:
    """``--print-commands``: the Slurm line, then each node's command (to run there, or
    over ssh from here), without starting anything."""
    print("# Slurm (one task per node, inside an allocation of these hosts):")
    print(slurm_command(args, hosts, master_port))
    print("# or on each node (node 0 hosts the rendezvous):")
    for node in node_commands(args, hosts, master_addr, master_port):
        print(f"# node {node.node_rank}: {node.host}")
        print(shlex.join(node.remote))


def _pump(host: str, stream: object, tail: deque[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, ""):  # type: ignore[attr-defined]
        line = raw.rstrip("\n")
        tail.append(line)
        with lock:
            print(f"{host}: {line}", flush=True)


def fan_out(nodes: list[NodeCommand], elastic: bool = False, grace: float = 30.0) -> int:
    """Start every node's command, stream their output, wait for all. Returns 0, or 1 with
    a summary naming each failing node and its last lines.

    The job is over when a node fails (``elastic``: when node 0, which hosts the rendezvous
    and so runs to the job's end, exits): the other nodes then get ``grace`` seconds to
    end on their own, as their ranks notice, before their sessions are stopped (a node cut
    off from the network would otherwise keep its ssh session open for minutes).
    ``elastic`` (``--nnodes MIN:MAX``): the job outlives the loss of nodes; it succeeded
    when node 0 did, and other nodes that failed are listed as lost."""
    lock = threading.Lock()
    running = []
    for node in nodes:
        proc = subprocess.Popen(
            node.remote,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        pump = threading.Thread(target=_pump, args=(node.host, proc.stdout, tail, lock))
        pump.start()
        running.append((node, proc, pump, tail))
    over_at: float | None = None
    stopped: set[int] = set()
    while any(proc.poll() is None for _, proc, _, _ in running):
        for node, proc, _, _ in running:
            code = proc.poll()
            ended = code is not None and (node.node_rank == 0 if elastic else code != 0)
            if ended and over_at is None:
                over_at = time.monotonic()
        if over_at is not None and time.monotonic() - over_at > grace:
            for node, proc, _, tail in running:
                if proc.poll() is None and node.node_rank not in stopped:
                    proc.kill()
                    stopped.add(node.node_rank)
                    tail.append(f"(stopped by the launcher {grace:.0f} s after the job ended)")
        time.sleep(0.2)
    failed = []
    for node, proc, pump, tail in running:
        pump.join()
        if proc.returncode != 0:
            failed.append((node, proc.returncode, list(tail)))
    if not failed:
        return 0
    if elastic and all(node.node_rank != 0 for node, _, _ in failed):
        lost = ", ".join(f"node {n.node_rank} ({n.host}, exit code {c})" for n, c, _ in failed)
        print(f"zerotrain run: the job finished without {lost}", file=sys.stderr)
        return 0
    print(
        f"zerotrain run: {len(failed)} of {len(nodes)} node(s) failed:",
        file=sys.stderr,
    )
    if any(node.node_rank == 0 for node, _, _ in failed) and len(nodes) > 1:
        print(
            f"zerotrain run: node 0 ({nodes[0].host}) hosts the rendezvous store; the other "
            "nodes cannot continue or restart without it (the job's single point of "
            "failure, docs/multinode.md)",
            file=sys.stderr,
        )
    for node, code, last in failed:
        print(f"--- node {node.node_rank} ({node.host}), exit code {code} ---", file=sys.stderr)
        for line in last:
            print(f"    {line}", file=sys.stderr)
    return 1

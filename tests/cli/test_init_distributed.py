"""``zerotrain.init_distributed`` with DeepSpeed's arguments, in real processes (it creates
the process group, so each case is a fresh interpreter): a ``tcp://`` init_method with
explicit rank and world size, an MPI launcher's variables (DeepSpeed's MPI discovery), no
launcher at all, and the refusals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
import zerotrain

kwargs = json.loads(sys.argv[1])
try:
    env = zerotrain.init_distributed(**kwargs)
    again = zerotrain.init_distributed(dist_init_required=True, verbose=False)
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    print(json.dumps({"rank": env.rank, "world": env.world_size, "backend": env.backend,
                      "sum": total.item(), "same": again.rank == env.rank}))
except (RuntimeError, ValueError) as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _launch(tmp_path: Path, kwargs: list[dict], envs: list[dict]) -> list[dict]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    base.update(OMP_NUM_THREADS="1", ZEROTRAIN_COMM_TIMEOUT="60")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), json.dumps(k)],
            env={**base, **e},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, e in zip(kwargs, envs, strict=True)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"no result (rc {proc.returncode}):\n{err[-2000:]}"
        results.append(json.loads(lines[-1]))
    return results


def test_tcp_init_method_with_explicit_rank_and_world_size(tmp_path):
    url = f"tcp://127.0.0.1:{_free_port()}"
    kwargs = [
        {"dist_backend": "gloo", "init_method": url, "rank": r, "world_size": 2} for r in (0, 1)
    ]
    results = _launch(tmp_path, kwargs, [{}, {}])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["same"] for r in results)
    assert all(r["backend"] == "gloo" for r in results)


def test_mpi_discovery_from_open_mpi_variables(tmp_path):
    port = _free_port()
    envs = [
        {
            "OMPI_COMM_WORLD_RANK": str(r),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
        }
        for r in (0, 1)
    ]
    # No MASTER_PORT: DeepSpeed's distributed_port is the rendezvous port.
    results = _launch(tmp_path, [{"distributed_port": port}] * 2, envs)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in results)


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({}, {}, {"rank": 0, "world": 1, "backend": "gloo", "sum": 1.0, "same": True}),
        ({"dist_init_required": False}, {}, "RuntimeError: init_distributed(dist_init_required"),
        ({"dist_backend": "nccl"}, {}, "ValueError: dist_backend 'nccl' needs CUDA tensors"),
        ({"dist_backend": "mpi"}, {}, "ValueError: dist_backend 'mpi' is not supported"),
        (
            {},
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
            "RuntimeError: launched by MPI (OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2) "
            "without MASTER_ADDR",
        ),
    ],
    ids=["no-launcher", "required-false", "nccl-on-cpu", "mpi-backend", "mpi-no-addr"],
)
def test_single_process_cases(tmp_path, kwargs, env, expected):
    (result,) = _launch(tmp_path, [kwargs], [{"ZEROTRAIN_DEVICE": "cpu", **env}])
    if isinstance(expected, str):
        assert result["error"].startswith(expected), result
    else:
        assert result == expected

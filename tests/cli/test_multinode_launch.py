"""``zerotrain run --hostfile H`` from one command across hosts: two hosts as network
namespaces, each with its own sshd; the launcher runs on the first (as on a login node that
is also node 0) and starts every node's ``zerotrain run --no_ssh`` over ssh. A job of 2 hosts
x 2 ranks trains and every rank sees world size 4 and the same weights; a job whose rank on
the second host raises exits non-zero with that host and its traceback in the summary.
Needs root and OpenSSH (skipped with the reason elsewhere; ``.ci/run`` installs OpenSSH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain.testing import netns

pytestmark = pytest.mark.skipif(
    netns.ssh_unavailable() is not None, reason=str(netns.ssh_unavailable())
)

TRAIN = """
import json, os, sys
import torch
import zerotrain

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, *_ = zerotrain.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
gen = torch.Generator().manual_seed(engine.comm.rank)
for _ in range(3):
    engine.backward(engine(torch.randn(2, 4, generator=gen)).pow(2).mean())
    engine.step()
out = sys.argv[1]
with open(f"{out}/rank{engine.comm.rank}.json", "w") as f:
    json.dump({"world": engine.comm.world_size, "host": os.environ.get("GLOO_SOCKET_IFNAME"),
               "weight": model.weight.detach().view(-1).tolist()}, f)
"""

FAIL = """
import os
import torch.distributed as dist
import zerotrain

zerotrain.init_distributed()
if dist.get_rank() == 3:
    raise RuntimeError("rank 3 on the second host fails on purpose")
dist.barrier()
"""


def _launch(tmp_path: Path, script: str, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    (tmp_path / "job.py").write_text(script)
    with netns.hosts(2) as placement:
        (tmp_path / "hostfile").write_text("".join(f"{h.address} slots=2\n" for h in placement))
        with netns.ssh_servers(placement, tmp_path) as ssh:
            env = {
                "PATH": os.environ["PATH"],
                "HOME": str(tmp_path),
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "ZEROTRAIN_COMM_TIMEOUT": "60",
            }
            argv = [
                sys.executable, "-m", "zerotrain.cli.main", "run",
                "--hostfile", str(tmp_path / "hostfile"), "--ssh-command", ssh,
                *extra, str(tmp_path / "job.py"), str(tmp_path),
            ]  # fmt: skip
            done = subprocess.run(
                placement[0].command(argv),
                capture_output=True,
                text=True,
                timeout=240,
                cwd=tmp_path,
                env=env,
            )
    return done, placement


def test_one_command_starts_every_host_over_ssh(tmp_path: Path):
    done, placement = _launch(tmp_path, TRAIN)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world"] for r in ranks} == {4}
    assert all(r["weight"] == ranks[0]["weight"] for r in ranks)
    # Each rank bound its own host's interface (chosen as the route to the rendezvous).
    assert [r["host"] for r in ranks] == [h.interface for h in placement for _ in range(2)]
    # The output came back with each host's name in front.
    assert f"{placement[1].address}: " in done.stdout


def test_a_failing_host_fails_the_job_and_is_named_with_its_traceback(tmp_path: Path):
    done, placement = _launch(tmp_path, FAIL)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "node(s) failed" in done.stderr
    assert f"node 1 ({placement[1].address})" in done.stderr
    assert "rank 3 on the second host fails on purpose" in done.stderr

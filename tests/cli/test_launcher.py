"""``zerotrain run``: real multi-process launches through torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TRAIN_SCRIPT = """
import json, os, sys
import torch
import zerotrain

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, _, _, _ = zerotrain.initialize(model=model)  # config comes from --config
for _ in range(2 * engine.gradient_accumulation_steps()):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 4)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
out = sys.argv[sys.argv.index("--out") + 1]
with open(f"{out}/rank{engine.comm.rank}.json", "w") as f:
    json.dump({"steps": engine.global_steps, "world": engine.comm.world_size,
               "omp": os.environ.get("OMP_NUM_THREADS"),
               "weight": model.weight.detach().view(-1).tolist()}, f)
"""

FAILING_SCRIPT = """
import torch.distributed as dist
import zerotrain

zerotrain.init_distributed()
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
dist.barrier()  # the other ranks wait here for a peer that is gone
"""


def _zerotrain(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerotrain.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "ZEROTRAIN_COMM_TIMEOUT": "60"},
    )


def test_run_launches_ranks_with_config_from_command_line(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT))
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_batch_size": 8,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            }
        )
    )
    proc = _zerotrain(
        "run", "-n", "2", str(script), "--config", str(config), "--out", str(tmp_path), timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["steps"] for r in ranks] == [2, 2]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["weight"] == ranks[1]["weight"]  # replicas stay identical


def test_failing_rank_fails_the_job_with_its_traceback(tmp_path: Path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAILING_SCRIPT))
    start = time.monotonic()
    proc = _zerotrain("run", "-n", "3", str(script), timeout=120)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 90, f"took {elapsed:.0f}s"
    assert "RuntimeError: rank 1 fails on purpose" in output
    assert "Traceback" in output
    assert "fail.py" in output
    assert "rank 1 failed first" in output


def test_bad_hostfile_is_reported_without_launching(tmp_path: Path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=two\n")
    proc = _zerotrain("run", "--hostfile", str(hostfile), "x.py", timeout=60)
    assert proc.returncode == 2
    assert "expected 'hostname slots=N'" in proc.stderr


def test_print_commands_gives_slurm_and_per_node_commands(tmp_path: Path):
    (tmp_path / "hostfile").write_text("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n")
    done = _zerotrain(
        "run", "--hostfile", str(tmp_path / "hostfile"), "--exclude", "worker-1",
        "--num_gpus", "2", "--master_port", "29600", "--print-commands",
        "train.py", "--deepspeed_config", "ds.json", timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "srun --nodes=2 --ntasks-per-node=1 --nodelist=worker-0,worker-2" in out
    assert "--nproc-per-node=2 --nnodes=2" in out
    assert "# node 1: worker-2" in out
    assert "ssh -o BatchMode=yes worker-2" in out
    assert "--node-rank=1 --master-addr=worker-0 --master-port=29600" in out
    assert "train.py --deepspeed_config ds.json" in out

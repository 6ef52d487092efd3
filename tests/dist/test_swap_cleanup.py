"""NVMe swap directories after a job is cancelled or killed (issue 29, item 6).

A real training process with its optimizer states swapped to files: SIGTERM (a scheduler
cancelling the job) removes its swap directory before the process ends; after SIGKILL the
directory stays, and the next job using the same path removes it (its process is gone),
with a log line, while a live job's directory is left alone. Under ``zerotrain run`` the
launcher removes the directory of a rank killed outright as soon as the job ends (issue 42).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from zerotrain.offload.swap import remove_stale_swap_directories

# One optimizer step with its states swapped to files under sys.argv[1]; each job adds how
# it ends.
_SWAPPED_STEP = textwrap.dedent(
    """
    import os, signal, sys, time, torch, zerotrain
    from zerotrain.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]},
            },
        },
    )
    x = torch.randint(0, 256, (2, 17))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    """
)
_JOB = _SWAPPED_STEP + 'print("ready", flush=True)\ntime.sleep(120)\n'


def _start(root: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRAIN_DEVICE": "cpu"}
    job = subprocess.Popen(
        [sys.executable, "-c", _JOB, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert job.stdout is not None
    assert job.stdout.readline().strip() == "ready"
    return job


def _swap_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("zerotrain-swap-*"))


def test_sigterm_removes_the_swap_directory(tmp_path: Path):
    job = _start(tmp_path)
    assert len(_swap_dirs(tmp_path)) == 1
    assert list(_swap_dirs(tmp_path)[0].glob("*.swp"))
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == -signal.SIGTERM  # still ends as SIGTERM ends a process
    assert _swap_dirs(tmp_path) == []


def test_a_killed_jobs_directory_is_swept_by_the_next(tmp_path: Path):
    killed = _start(tmp_path)
    killed.kill()
    killed.wait(timeout=30)
    (stale,) = _swap_dirs(tmp_path)
    live = _start(tmp_path)  # a live job's directory must survive the sweep
    try:
        old = time.time() - 3600
        os.utime(stale, (old, old))
        removed = remove_stale_swap_directories(tmp_path)
        assert removed == [stale]
        assert len(_swap_dirs(tmp_path)) == 1  # the live job's
    finally:
        live.kill()
        live.wait(timeout=30)


# No chance to clean up, as under the OOM killer.
_KILLED_RANK = _SWAPPED_STEP + "os.kill(os.getpid(), signal.SIGKILL)\n"


def test_zerotrain_run_removes_a_killed_ranks_swap_directory(tmp_path: Path):
    script, root = tmp_path / "train.py", tmp_path / "swap"
    script.write_text(_KILLED_RANK)
    root.mkdir()
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "ZEROTRAIN_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "zerotrain.cli.main", "run", "-n", "1", str(script), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr  # the rank was killed
    assert _swap_dirs(root) == [], proc.stderr
    assert "left by a rank that ended" in proc.stderr, proc.stderr

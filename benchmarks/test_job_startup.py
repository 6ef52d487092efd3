"""What a multi-process test pays before its first step: one job that builds an engine and
trains one step of a tiny model, run as fresh ranks (the forkserver preloading what it did
before 2026-11-28, and what it preloads now) and in a worker pool that outlives the job.

    OMP_NUM_THREADS=1 python benchmarks/test_job_startup.py [--repeats 5]

Prints the median wall time of a job per world size and mode (docs/testing.md has the
figures). Each mode runs in a fresh interpreter: the forkserver's preload list is fixed at
its start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = ("fresh, old preload", "fresh, preload now", "pooled")
OLD_PRELOAD = ["torch", "torch.distributed", "zerotrain"]


def one_step() -> float:
    import torch
    import torch.distributed as dist

    import zerotrain

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {
        "train_batch_size": 2 * dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 16)).sum()
    engine.backward(loss)
    engine.step()
    return float(loss)


def _measure(mode: str, world_sizes: list[int], repeats: int) -> dict[int, float]:
    from zerotrain.testing import dist as harness

    if mode == "fresh, old preload":
        harness._PRELOAD[:] = OLD_PRELOAD
    harness.use_pools(mode == "pooled")
    out = {}
    for world_size in world_sizes:
        if mode == "pooled":  # the pool's own start is paid once per session, not per job
            harness.run_distributed(one_step, world_size)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            harness.run_distributed(one_step, world_size)
            times.append(time.perf_counter() - start)
        out[world_size] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if args.mode:  # one mode, in this interpreter
        print(json.dumps(_measure(args.mode, world_sizes, args.repeats)))
        return
    rows = {}
    for mode in MODES:
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--repeats", str(args.repeats),
             "--world-sizes", args.world_sizes],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows[mode] = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    print("| world size | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for ws in world_sizes:
        print(f"| {ws} | " + " | ".join(f"{rows[m][ws]:.2f} s" for m in MODES) + " |")


if __name__ == "__main__":
    main()

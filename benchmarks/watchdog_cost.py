"""What the peer watchdog (on by default since 2026-11-28, issue 42) costs a training step.

Two ranks over gloo TCP (``ZEROTRAIN_SHM=0``, as between hosts), the demo GPT at ZeRO stage 2,
``--steps`` steps per job; jobs alternate between the watchdog on (``ZEROTRAIN_PEER_TIMEOUT``
unset: the heartbeat timeout) and off (``0``), ``--repeats`` of each. A job's figure is its
median step (the slower rank's); the ratio is paired per repeat (off / on: above 1 means the
watchdog made steps slower).

    OMP_NUM_THREADS=1 python benchmarks/watchdog_cost.py [--repeats 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _job(steps: int) -> float:
    import zerotrain
    from zerotrain.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=GPT(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128)),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**6,
        },
    )
    times = []
    for step in range(steps + 3):
        x = torch.randint(0, 256, (4, 65))
        start = time.perf_counter()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        if step >= 3:  # warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from zerotrain.testing.dist import run_distributed

    results: dict[str, list[float]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for mode in order:
            env = {"ZEROTRAIN_SHM": "0"}
            if mode == "off":
                env["ZEROTRAIN_PEER_TIMEOUT"] = "0"
            ranks = run_distributed(_job, 2, args.steps, env=env, own_processes="a setting")
            results[mode].append(max(ranks))
        print(f"[{repeat + 1}/{args.repeats}] on {1e3 * results['on'][-1]:.2f} ms, "
              f"off {1e3 * results['off'][-1]:.2f} ms", flush=True)  # fmt: skip
    ratios = [on / off for on, off in zip(results["on"], results["off"], strict=True)]
    print(
        f"\nwatchdog on: {1e3 * statistics.median(results['on']):.2f} ms/step, off: "
        f"{1e3 * statistics.median(results['off']):.2f} ms/step; on / off, paired median of "
        f"{args.repeats}: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()

"""Ulysses sequence parallelism: the longest sequence SP=2 and SP=1 each train in 60 s.

The demo GPT (``--n-layer`` blocks of width ``--n-embd``, ``--n-head`` heads, byte
vocabulary, tied head), one sequence per step, AdamW with gradient clipping, through
``zerotrain.initialize`` with ``sequence_parallel_size`` 1 (one process) or 2 (two
processes on this 2-core machine: each holds half of every sequence, and runs attention on
the whole sequence for half of the heads after an all-to-all; ``engine.shard_sequence``
gives each its slice). Every rank runs with ``OMP_NUM_THREADS=1``.

"Trains in 60 s": a job of one warm-up step and ``--steps`` measured steps finishes its
steps within ``--budget`` seconds (start-up excluded). For each degree the sequence length
doubles from ``--start`` until a job misses the budget; the midpoint between the last
length that made it and the first that did not is tried once more. Every job is one
fresh set of processes. Reported per job: the median step time (the slower rank's), tokens
per second, and the largest resident set of any rank (``VmHWM``: start-up included).

At the lengths both degrees ran, "SP=2 / SP=1" is the ratio of median step times.

    OMP_NUM_THREADS=1 python benchmarks/ulysses.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.testing.dist import run_distributed


def _vm_hwm() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _job(length: int, args: dict[str, Any]) -> dict[str, Any]:
    import zerotrain

    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=length, n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"]
    )
    degree = int(os.environ["WORLD_SIZE"])
    engine, _, _, _ = zerotrain.initialize(
        model=GPT(cfg),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "zero_optimization": {"stage": 1},
            "sequence_parallel_size": degree,
            "steps_per_print": 10**6,
        },
    )
    sequence = engine.groups.sequence
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    start = time.perf_counter()
    for step in range(1 + args["steps"]):
        tokens = torch.randint(0, cfg.vocab_size, (1, length + 1), generator=gen)
        batch = engine.shard_sequence({"idx": tokens[:, :-1], "targets": tokens[:, 1:]})
        sequence.barrier()
        began = time.perf_counter()
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        took = sequence.all_reduce_floats([time.perf_counter() - began], op="max")[0]
        if step:
            times.append(took)
        losses.append(sequence.all_reduce_floats([loss.item()])[0] / sequence.world_size)
    elapsed = time.perf_counter() - start
    peak = sequence.all_reduce_floats([float(_vm_hwm())], op="max")[0]
    return {
        "step_s": statistics.median(times),
        "elapsed_s": elapsed,
        "peak_rss": peak,
        "losses": losses,
    }


def _run(length: int, degree: int, args: dict[str, Any]) -> dict[str, Any] | None:
    try:
        result = run_distributed(
            _job,
            degree,
            length,
            args,
            timeout=args["budget"] * 3 + 120,
            env={"OMP_NUM_THREADS": "1"},
        )[0]
    except Exception as err:
        print(
            f"  SP={degree} L={length}: failed: {str(err).splitlines()[0][:200]}", file=sys.stderr
        )
        return None
    result["fits"] = result["elapsed_s"] <= args["budget"]
    print(
        f"  SP={degree} L={length}: step {result['step_s']:.2f} s, "
        f"job {result['elapsed_s']:.1f} s, "
        f"peak RSS {result['peak_rss'] / 2**20:.0f} MiB, {'fits' if result['fits'] else 'over'}",
        file=sys.stderr,
    )
    return result


def _longest(degree: int, args: dict[str, Any]) -> dict[int, dict[str, Any]]:
    runs: dict[int, dict[str, Any]] = {}
    length, last_fit = args["start"], None
    while True:
        result = _run(length, degree, args)
        if result is not None:
            runs[length] = result
        if result is None or not result["fits"]:
            break
        last_fit, length = length, length * 2
    if last_fit is not None:
        middle = (last_fit + length) // 2 // 64 * 64
        if middle not in runs:
            result = _run(middle, degree, args)
            if result is not None:
                runs[middle] = result
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--json")
    args = vars(parser.parse_args())
    results = {degree: _longest(degree, args) for degree in (1, 2)}
    if args["json"]:
        with open(args["json"], "w") as out:
            json.dump({"args": args, "results": results}, out, indent=1)
    print(f"budget {args['budget']:.0f} s for 1 warm-up + {args['steps']} steps, batch 1\n")
    print("| SP | sequence | median step s | tokens/s | peak RSS MiB | in budget |")
    print("|---|---|---|---|---|---|")
    for degree, runs in results.items():
        for length, r in sorted(runs.items()):
            print(
                f"| {degree} | {length} | {r['step_s']:.2f} | {length / r['step_s']:.0f} | "
                f"{r['peak_rss'] / 2**20:.0f} | {'yes' if r['fits'] else 'no'} |"
            )
    for degree, runs in results.items():
        fit = [n for n, r in runs.items() if r["fits"]]
        print(f"\nSP={degree}: longest sequence in budget {max(fit) if fit else 'none'}")
    common = sorted(set(results[1]) & set(results[2]))
    for length in common:
        ratio = results[2][length]["step_s"] / results[1][length]["step_s"]
        print(f"L={length}: SP=2 / SP=1 step time {ratio:.3f}")


if __name__ == "__main__":
    main()

"""The memory estimator against measured peak resident memory: the demo GPT, 2 ranks.

Each configuration (ZeRO stage x dtype) runs in a fresh pair of processes, started with
``MALLOC_MMAP_THRESHOLD_=65536`` so glibc maps every tensor on its own and freed memory
leaves the resident set (as it leaves a GPU allocator's pool). Every rank first trains one
step of a 1-layer, 8-wide GPT with the same config and records its resident memory after
(interpreter, torch, loaded kernels, gloo and the shared-memory arena: the baseline), builds
the demo's model (``examples/train_gpt.py``: 4 layers, 4 heads, width 192, 128 tokens) with
the demo's config (AdamW, two parameter groups, micro-batch 16), and trains a few steps
inside ``PeakRSSMeter``. The prediction is the baseline plus ``estimate_memory(...).total``
for a CPU rank (model states, gradient staging, stage-3 working set, and the GPT's
activations: see ``zerotrain/estimate/activations.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/estimator.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

STEPS = 3


def _measure(stage: int, dtype: str, micro_batch: int, steps: int) -> dict[str, Any]:
    """On every rank: baseline, predicted and measured peak RSS for one configuration."""
    import zerotrain
    from zerotrain.estimate import compare, estimate_memory
    from zerotrain.examples.gpt import GPT, GPTConfig, param_groups
    from zerotrain.utils.memory import PeakRSSMeter, current_rss_bytes, release_free_memory

    cfg = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=192)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**6,
    }
    # The baseline: everything a process holds that does not grow with the model. One step
    # of a 1-layer, 8-wide GPT loads the kernels and sets up the communicator (gloo, the
    # shared-memory arena), which then stay; what is resident after it is the baseline.
    tiny = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8))
    warm, *_ = zerotrain.initialize(model=tiny, config=config)
    tokens = torch.randint(0, 256, (micro_batch, 9))
    warm.backward(warm(tokens[:, :-1], tokens[:, 1:]))
    warm.step()
    warm.destroy()
    del warm, tiny, tokens
    gc.collect()
    release_free_memory()
    baseline = current_rss_bytes()
    with torch.device("meta"):
        shape_model = GPT(cfg)
    predicted = estimate_memory(
        shape_model,
        world_size=world,
        stage=stage,
        dtype=dtype,
        micro_batch=micro_batch,
        seq_len=cfg.block_size,
        optimizer="adamw",
        device="cpu",
        rank=rank,
        baseline_bytes=baseline,
    )
    gen = torch.Generator().manual_seed(rank)
    with PeakRSSMeter() as meter:
        torch.manual_seed(0)
        model = GPT(cfg)
        engine, *_ = zerotrain.initialize(
            model=model, model_parameters=param_groups(model, 0.1), config=config
        )
        for _ in range(steps):
            tokens = torch.randint(0, 256, (micro_batch, cfg.block_size + 1), generator=gen)
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
    breakdown = engine.memory_breakdown()
    report = compare(predicted, breakdown, meter.peak_bytes)
    engine.destroy()
    return {
        "baseline": baseline,
        "predicted": predicted.host_bytes,
        "activations": predicted.activations.total,
        "states": predicted.total - predicted.activations.total,
        "measured": meter.peak_bytes,
        "report": report,
    }


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        # glibc reads it at process start: the ranks (forked from a server this process
        # starts) must inherit it, so restart with it set.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from zerotrain.testing.dist import run_distributed
    from zerotrain.utils.memory import format_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--micro-batch", type=int, default=16, help="the demo's default")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--verbose", action="store_true", help="print compare() per rank")
    args = parser.parse_args()
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        for dtype in args.dtypes.split(","):
            results = run_distributed(
                _measure,
                2,
                stage,
                dtype,
                args.micro_batch,
                args.steps,
                timeout=600,
            )
            for rank, r in enumerate(results):
                rows.append((stage, dtype, rank, r))
                if args.verbose:
                    print(f"stage {stage} {dtype} rank {rank}\n{r['report']}\n")
    head = (
        f"{'stage':>5} {'dtype':>5} {'rank':>4} {'baseline':>10} {'states':>10} "
        f"{'activ.':>10} {'predicted':>10} {'measured':>10} {'error':>7}"
    )
    print(head)
    print("-" * len(head))
    worst = 0.0
    for stage, dtype, rank, r in rows:
        error = (r["predicted"] - r["measured"]) / r["measured"]
        worst = max(worst, abs(error))
        print(
            f"{stage:>5} {dtype:>5} {rank:>4} {format_bytes(r['baseline']):>10} "
            f"{format_bytes(r['states']):>10} {format_bytes(r['activations']):>10} "
            f"{format_bytes(r['predicted']):>10} {format_bytes(r['measured']):>10} "
            f"{100 * error:>+6.1f}%"
        )
    print(f"largest error: {100 * worst:.1f}% (peak RSS per rank, 2 ranks, demo GPT)")


if __name__ == "__main__":
    main()

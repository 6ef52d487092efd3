"""The demo GPT at sequence 4096 with block-sparse attention against the same model dense
(issue 25): 2 ranks, ZeRO-2, the same data, schedule and seed; loss at equal steps.

    OMP_NUM_THREADS=1 python benchmarks/sparse_attention_training.py --steps 300 \\
        --json /tmp/zt/sa_train.json --png benchmarks/sparse_attention_training.png

The sparse model gets the layout from the config's ``sparse_attention`` section (applied by
``initialize``): BigBird, causal, block 64, one random block, a window of 3 blocks and one
global block per row. The final loss is the mean of the last 20 steps' training losses; the
held-out loss is measured after training on 8 windows the run never saw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

SECTION = {
    "mode": "bigbird",
    "block": 64,
    "num_random_blocks": 1,
    "num_sliding_window_blocks": 3,
    "num_global_blocks": 1,
    "attention": "unidirectional",
}


def _windows(data: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (count,), generator=gen)
    return data[starts[:, None] + torch.arange(length + 1)]


def _train(sparse: bool, opts: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: ``steps`` steps of ZeRO-2 on this rank's sequence of each step."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.examples.corpus import load_corpus
    from zerotrain.examples.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(block_size=opts["seq"], n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    config: dict[str, Any] = {
        "train_batch_size": world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opts["lr"], "weight_decay": 0.01, "betas": [0.9, 0.95]},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": opts["steps"],
                "warmup_num_steps": opts["warmup"],
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    if sparse:
        config["sparse_attention"] = SECTION
    engine, *_ = zerotrain.initialize(model=model, config=config)
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    held_out = len(data) * 9 // 10  # the last tenth is only evaluated
    train = _windows(data[:held_out], opts["steps"] * world, opts["seq"], seed=1)
    losses, seconds = [], []
    for step in range(opts["steps"]):
        window = train[step * world + rank]
        start = time.perf_counter()
        loss = engine(window[None, :-1], window[None, 1:])
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        total = torch.tensor([float(loss)])
        dist.all_reduce(total)
        losses.append(float(total) / world)
    model.eval()
    evals = _windows(data[held_out:], 8, opts["seq"], seed=2)
    with torch.no_grad():
        held = statistics.mean(float(model(w[None, :-1], w[None, 1:])) for w in evals)
    return {"losses": losses, "seconds": seconds, "held_out": held}


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("dense", "k-"), ("sparse", "C0-")):
        losses = np.asarray(results[name]["losses"])
        smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
        label = (
            f"{name} (final {results[name]['final']:.3f}, held-out {results[name]['held_out']:.3f})"
        )
        ax.plot(np.arange(len(smooth)) + 10, smooth, style, lw=1.2, label=label)
    density = results["density"]
    ax.set_title(
        f"Demo GPT, seq {results['options']['seq']}, 2 ranks, ZeRO-2: BigBird "
        f"({100 * density:.1f}% of the matrix) vs dense attention",
        fontsize=10,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from zerotrain.sparse_attention import SparseSelfAttention, sparsity_config_from_dict
    from zerotrain.testing.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    opts = {"steps": args.steps, "seq": args.seq, "lr": args.lr, "warmup": args.warmup}
    attention = SparseSelfAttention(sparsity_config_from_dict(SECTION, 4), max_seq_length=args.seq)
    results: dict[str, Any] = {"options": opts, "density": attention.density(args.seq)}
    for name in ("sparse", "dense"):
        ranks = run_distributed(_train, 2, name == "sparse", opts, timeout=args.steps * 60 + 600)
        run = ranks[0]
        run["final"] = statistics.mean(run["losses"][-20:])
        run["seconds_per_step"] = statistics.median(run["seconds"])
        results[name] = run
        print(
            json.dumps({name: {k: run[k] for k in ("final", "held_out", "seconds_per_step")}}),
            flush=True,
        )
    results["final_ratio"] = results["sparse"]["final"] / results["dense"]["final"]
    results["held_out_ratio"] = results["sparse"]["held_out"] / results["dense"]["held_out"]
    print(json.dumps({k: results[k] for k in ("density", "final_ratio", "held_out_ratio")}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.png:
        _plot(results, args.png)


if __name__ == "__main__":
    main()

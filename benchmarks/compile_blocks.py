"""Per-block torch.compile (inductor) against eager blocks, at ZeRO stages 0-3, on CPU.

    OMP_NUM_THREADS=1 python benchmarks/compile_blocks.py --json /tmp/zt/compile_blocks.json

A GPT (4 blocks of width 64 or 256, 4 heads, 128 tokens, micro-batch 8, no accumulation,
AdamW, clipping 1.0) on ``--world`` ranks over gloo: width 64 is bound by the host's work
per op (what fusing pointwise ops saves), width 256 by its matrix products (which compile
leaves to the same library). bf16 only at width 64: this machine's CPU (AVX2, no AVX-512
BF16 or AMX) multiplies bf16 matrices 25x slower than fp32 ones, so at width 256 both runs
measure that. Each block is compiled with
``block.compile()`` before ``initialize`` (the style torchtitan uses, one graph per block;
stage 3's gathers and frees run eagerly between them). For each setting the eager and the
compiled run alternate ``--repeats`` times; each run times ``--steps`` steps after
``--warmup`` (the compile happens there) and reports its median step; the table gives the
median over the repeats and compiled / eager. The losses of the two are printed too: the
same data, so they agree to about 1e-6 (tests/dist/test_compile.py checks parity).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

# (width, stage, precision)
SETTINGS = [
    (64, 0, "fp32"),
    (64, 3, "fp32"),
    (64, 0, "bf16"),
    (64, 3, "bf16"),
    (256, 0, "fp32"),
    (256, 3, "fp32"),
]


def _run(
    width: int, stage: int, precision: str, compiled: bool, warmup: int, steps: int
) -> dict[str, Any]:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=width, bias=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    if compiled:
        for block in model.blocks:
            block.compile()
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    times, losses = [], []
    for i in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=data)
        start = time.perf_counter()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from zerotrain.testing.dist import run_distributed

    rows: list[dict[str, Any]] = []
    print(
        "| width | stage | precision | eager step | compiled step | compiled / eager | loss gap |"
    )
    print("|---|---|---|---|---|---|---|")
    for width, stage, precision in SETTINGS:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for compiled in (False, True):
                ranks = run_distributed(
                    _run, args.world, width, stage, precision, compiled, args.warmup,
                    args.steps,
                    timeout=900,
                )  # fmt: skip
                runs[compiled].append(ranks[0])
        eager = statistics.median(r["step_s"] for r in runs[False])
        fast = statistics.median(r["step_s"] for r in runs[True])
        pairs = zip(runs[False][0]["losses"], runs[True][0]["losses"], strict=True)
        gap = max(abs(a - b) for a, b in pairs)
        rows.append(
            {"width": width, "stage": stage, "precision": precision, "eager_s": eager,
             "compiled_s": fast,
             "ratio": fast / eager, "loss_gap": gap}
        )  # fmt: skip
        print(
            f"| {width} | {stage} | {precision} | {1000 * eager:.1f} ms | {1000 * fast:.1f} ms | "
            f"{fast / eager:.2f} | {gap:.1e} |",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

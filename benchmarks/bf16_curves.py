"""bf16 against fp32 over a long horizon, at ZeRO stages 0-3 (the test checks 30 steps).

    OMP_NUM_THREADS=1 python benchmarks/bf16_curves.py --steps 300 \\
        --png benchmarks/bf16_curves.png --json /tmp/zt/bf16_curves.json

The demo GPT (tests/dist/test_precision.py's, 2 ranks, accumulation 2, clipping at 1.0,
AdamW at 1e-3) trains the same global batches in bf16 (bf16 parameters and compute, fp32
master) at each stage, against plain PyTorch fp32 training of the whole global batch in one
process. Printed per stage: the largest relative gap of the step losses (and of their
10-step means, which takes out the noise of single steps), and the final 10-step mean
against the reference's. The PNG shows the curves and the relative gap of the means.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the same model, data and reference as the test

WINDOW = 10


def _spec(steps: int, stage: int | None) -> Any:
    """The test's run: fp32 (``stage`` None, the reference) or bf16 at ``stage``."""
    from tests.helpers.training import DEMO_RUN, RunSpec, zero_section

    if stage is None:
        return RunSpec(steps=steps, **DEMO_RUN)
    extra = {"bf16": {"enabled": True}, "zero_optimization": zero_section(stage)}
    return RunSpec(stage=stage, steps=steps, extra_config=extra, **DEMO_RUN)


def _train(spec: Any) -> list[float]:
    from tests.helpers.training import train_zerotrain

    return list(train_zerotrain(spec)["losses"])


def _means(losses: list[float]) -> np.ndarray:
    return np.convolve(np.asarray(losses), np.ones(WINDOW) / WINDOW, mode="valid")


def _summary(curve: list[float], ref: list[float]) -> dict[str, float]:
    got, want = np.asarray(curve), np.asarray(ref)
    return {
        "max_rel_gap_steps": float(np.max(np.abs(got - want) / want)),
        "max_rel_gap_means": float(np.max(np.abs(_means(curve) - _means(ref)) / _means(ref))),
        "final_mean": float(got[-WINDOW:].mean()),
        "reference_final_mean": float(want[-WINDOW:].mean()),
    }


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = curves["fp32"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = np.arange(WINDOW, len(ref) + 1)
    top.plot(steps, _means(ref), "k-", lw=2, label="fp32, one process")
    for i, (name, curve) in enumerate(c for c in curves.items() if c[0] != "fp32"):
        top.plot(steps, _means(curve), f"C{i}-", lw=1, label=name)
        gap = 100 * (_means(curve) - _means(ref)) / _means(ref)
        bottom.plot(steps, gap, f"C{i}-", lw=1, label=name)
    top.set_ylabel(f"training loss ({WINDOW}-step mean)")
    top.legend()
    top.set_title("bf16 (fp32 master) against fp32: the demo GPT, 2 ranks")
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("bf16 - fp32, % of fp32")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--png", default="benchmarks/bf16_curves.png")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from tests.helpers.training import train_reference
    from zerotrain.testing.dist import run_distributed

    curves: dict[str, list[float]] = {"fp32": train_reference(_spec(args.steps, None), 2)["losses"]}
    summaries: dict[str, dict[str, float]] = {}
    for stage in (int(s) for s in args.stages.split(",")):
        ranks = run_distributed(_train, 2, _spec(args.steps, stage), timeout=60 + 2 * args.steps)
        name = f"bf16 stage {stage}"
        curves[name] = ranks[0]
        summaries[name] = _summary(ranks[0], curves["fp32"])
        s = summaries[name]
        print(
            f"{name}: largest gap {100 * s['max_rel_gap_steps']:.2f}% of a step's loss, "
            f"{100 * s['max_rel_gap_means']:.2f}% of a {WINDOW}-step mean; final mean "
            f"{s['final_mean']:.4f} vs fp32 {s['reference_final_mean']:.4f}",
            flush=True,
        )
    if args.png:
        _plot(curves, Path(args.png))
        print(f"wrote {args.png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"curves": curves, "summaries": summaries}))


if __name__ == "__main__":
    main()

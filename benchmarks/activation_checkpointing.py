"""Activation checkpointing: peak memory of a training step and its time, side by side.

A 12-block GPT (GPT-2 small's width by default) at sequence length 1024 trains with dropout
0.1 and AdamW, one process per variant (so each variant's memory is its own):

- ``none``: every activation stored;
- ``zerotrain``: ``zerotrain.checkpointing.apply(model)`` (every block);
- ``torch``: PyTorch's ``apply_activation_checkpointing`` with the non-reentrant wrapper (what
  FSDP2 users reach for);
- ``deepspeed``: ``deepspeed.checkpointing.checkpoint`` around every block (reentrant), when
  DeepSpeed is installed.

Memory: one process per variant, where glibc is told to map every tensor on its own
(``MALLOC_MMAP_THRESHOLD_``) so that freed activations leave the resident set; the peak
memory of a step is the peak resident set during forward + backward + optimizer step above
the resident set before it (parameters, gradients and Adam state exist already: the first
step is warm-up). Time: mapping every tensor afresh slows steps, the more so the more
activations are stored, so times come from one more process with the allocator's default
behaviour, where every variant has its own model and the variants take turns step by step
(drift of the machine's speed affects them alike); the median over the steps after
warm-up. Every variant draws the same dropout masks, so their losses must be equal.

    OMP_NUM_THREADS=2 python benchmarks/activation_checkpointing.py
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

VARIANTS = ("none", "zerotrain", "torch", "deepspeed")


def _checkpoint_blocks(model: torch.nn.Module, variant: str) -> None:
    from zerotrain.examples.gpt import Block

    if variant == "zerotrain":
        from zerotrain import checkpointing

        checkpointing.apply(model)
    elif variant == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
        )
    elif variant == "deepspeed":
        import deepspeed

        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29591")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        deepspeed.checkpointing.configure(None)
        for block in model.blocks:
            forward = block.forward
            block.forward = functools.partial(deepspeed.checkpointing.checkpoint, forward)


class _Trainee:
    """One variant: its own model (same initial weights as the others) and optimizer."""

    def __init__(self, variant: str, args: argparse.Namespace) -> None:
        from zerotrain.examples.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        cfg = GPTConfig(
            block_size=args.seq,
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.width,
            dropout=0.1,
        )
        self.model = GPT(cfg)
        _checkpoint_blocks(self.model, variant)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.rng = torch.Generator().manual_seed(1)  # the variants draw the same dropout masks
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=False)
        torch.set_rng_state(self.rng.get_state())
        start = time.perf_counter()
        loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        seconds = time.perf_counter() - start
        self.rng.set_state(torch.get_rng_state())
        self.losses.append(loss.item())
        return seconds


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from zerotrain.utils.memory import PeakRSSMeter

    data = torch.randint(
        0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    x, y = data[:, :-1], data[:, 1:]
    if args.measure == "memory":  # one variant per process: its peak is its own
        trainee = _Trainee(args.variant, args)
        trainee.step(x, y)  # warm-up: gradients and Adam state come to exist
        with PeakRSSMeter() as meter:
            trainee.step(x, y)
        return {"peak_MiB": meter.increase_bytes / 2**20}
    # Time: every variant in this one process, steps interleaved, so that drift of the
    # machine's speed over the run affects them alike.
    trainees = {v: _Trainee(v, args) for v in args.variant.split(",")}
    for step in range(args.warmup + args.steps):
        for trainee in trainees.values():
            seconds = trainee.step(x, y)
            if step >= args.warmup:
                trainee.times.append(seconds)
    return {
        v: {
            "params": t.model.num_parameters(),
            "step_s": statistics.median(t.times),
            "losses": t.losses,
        }
        for v, t in trainees.items()
    }


def _child_run(variant: str, measure: str, args: argparse.Namespace) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--measure", measure]
    for key in ("layers", "width", "heads", "seq", "batch", "steps", "warmup"):
        cmd += [f"--{key}", str(getattr(args, key))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if measure == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:  # DeepSpeed may abort at exit after printing its result
        print(f"{variant} ({measure}): failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    variants = args.variants.split(",")
    if "deepspeed" in variants and importlib.util.find_spec("deepspeed") is None:
        variants.remove("deepspeed")
    results = _child_run(",".join(variants), "time", args)
    if results is None:
        raise SystemExit("the timing run failed")
    for variant in variants:
        memory = _child_run(variant, "memory", args)
        results[variant]["peak_MiB"] = memory["peak_MiB"] if memory else float("nan")
    base = results["none"]
    print(
        f"{args.layers}-block GPT, {base['params'] / 1e6:.1f}M parameters, sequence {args.seq}, "
        f"batch {args.batch}, dropout 0.1, AdamW; torch threads {torch.get_num_threads()}"
    )
    print("| variant | step time (s) | vs none | peak step memory (MiB) | vs none | losses equal |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | "
            f"{r['peak_MiB']:.0f} | {r['peak_MiB'] / base['peak_MiB']:.2f}x | "
            f"{'yes' if r['losses'] == base['losses'] else 'no'} |"
        )


if __name__ == "__main__":
    main()

"""What a zerotrain step costs the host, against a hand-written loop of the same arithmetic
(issue 43): aten operations dispatched per step (each is about one kernel launch on a GPU,
collectives included) and CPU step time, on a model of many small parameters, where the
compute is negligible and the per-parameter host work shows.

The model: the demo GPT with 24 blocks of width 32 (293 parameter tensors), micro-batch 2,
sequence 32. Each case runs in fresh processes; world size 2 runs over gloo TCP
(``ZEROTRAIN_SHM=0``), so that every collective is one dispatched operation and counted.

- ``hand``: fp32: torch's AdamW (fused) with ``clip_grad_norm_(foreach=True)``; bf16:
  bf16 weights stepped through fp32 master copies by fused AdamW with clipping
  (zerotrain's ``bf16``). World size 2 adds one flat all-reduce of the gradients and its
  scaling (what a careful hand loop does: one coalesced collective).
- ``engine``: ``zerotrain.initialize`` with the same optimizer, clipping and precision, at
  ZeRO stages 0-3.

Ops are counted over one steady-state step with a ``TorchDispatchMode`` on rank 0; time is
the median of 5 windows of 5 steps (after 3 warm-up steps), the slower rank's.

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py [--worlds 1 2] [--stages 0 1 2 3]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

CFG = {"block_size": 32, "n_layer": 24, "n_head": 2, "n_embd": 32}
MICRO, LR, WD, CLIP = 2, 1e-3, 0.01, 1.0
WARMUP, WINDOWS, PER_WINDOW = 3, 5, 5


class OpCounter(TorchDispatchMode):
    """Counts every operation dispatched (aten and c10d), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model(precision: str) -> torch.nn.Module:
    from zerotrain.examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _hand_step(model: torch.nn.Module, precision: str) -> Callable[..., torch.Tensor]:
    world = dist.get_world_size()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params] if precision == "bf16" else params
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        grads = [p.grad for p in params]
        if world > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            dist.all_reduce(flat)
            flat.div_(world)
            pieces = flat.split([g.numel() for g in grads])  # type: ignore[union-attr]
            views = [piece.view_as(g) for piece, g in zip(pieces, grads, strict=True)]  # type: ignore[arg-type]
            torch._foreach_copy_(grads, views)  # type: ignore[arg-type]
        if precision == "bf16":
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float()  # type: ignore[union-attr]
                p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, CLIP, foreach=True)
        opt.step()
        if precision == "bf16":
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        for m in masters:
            m.grad = None
        return loss.detach()

    return step


def _engine_step(model: torch.nn.Module, precision: str, stage: int) -> Callable[..., Any]:
    import zerotrain

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zerotrain.initialize(model=model, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _case(system: str, precision: str, stage: int) -> dict[str, Any]:
    """One rank: ops of one steady step (rank 0) and the median step time."""
    model = _model(precision)
    step = (
        _hand_step(model, precision) if system == "hand" else _engine_step(model, precision, stage)
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    data = []
    for _ in range(4):
        ids = torch.randint(0, 256, (MICRO, CFG["block_size"] + 1), generator=g)
        data.append((ids[:, :-1], ids[:, 1:]))
    for i in range(WARMUP):
        step(*data[i % 4])
    counter = OpCounter()
    with counter:
        step(*data[0])
    times = []
    for _ in range(WINDOWS):
        start = time.perf_counter()
        for i in range(PER_WINDOW):
            step(*data[i % 4])
        times.append((time.perf_counter() - start) / PER_WINDOW)
    return {
        "ops": sum(counter.ops.values()),
        "by_op": dict(counter.ops),
        "step_s": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--top", type=int, default=0, help="print the N ops the engine adds most")
    args = parser.parse_args()
    from zerotrain.testing.dist import run_distributed

    def run(world: int, system: str, precision: str, stage: int) -> dict[str, Any]:
        ranks = run_distributed(
            _case, world, system, precision, stage, env={"ZEROTRAIN_SHM": "0"},
            own_processes="fresh processes per case", timeout=600,
        )  # fmt: skip
        return {**ranks[0], "step_s": max(r["step_s"] for r in ranks)}

    columns = (
        "world", "precision", "stage", "ops: engine / hand", "time: engine / hand",
        "engine ops", "hand ops", "engine ms", "hand ms",
    )  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for world in args.worlds:
        for precision in args.precisions:
            hand = run(world, "hand", precision, 0)
            for stage in args.stages:
                engine = run(world, "engine", precision, stage)
                print(
                    f"| {world} | {precision} | {stage} | {engine['ops'] / hand['ops']:.2f} | "
                    f"{engine['step_s'] / hand['step_s']:.2f} | {engine['ops']} | {hand['ops']} | "
                    f"{1e3 * engine['step_s']:.1f} | {1e3 * hand['step_s']:.1f} |",
                    flush=True,
                )
                if args.top:
                    extra = collections.Counter(engine["by_op"])
                    extra.subtract(hand["by_op"])
                    print(
                        "    most added:",
                        ", ".join(f"{op} {n:+d}" for op, n in extra.most_common(args.top)),
                    )


if __name__ == "__main__":
    main()

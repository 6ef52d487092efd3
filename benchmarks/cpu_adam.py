"""CPU Adam throughput: parameters updated per second on one fp32 shard.

The kernel of the offloaded optimizer step (ZeRO-Offload) against its peers, all AdamW (lr
1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) on the same shard: ``--numel`` fp32
parameters with their gradient, the two moments created by each optimizer:

- ``zerotrain``: ``zerotrain.optim.cpu_adam.adam_step_`` over the whole shard;
- ``zerotrain+bf16``: the same, also writing the updated parameters to a bf16 copy (what the
  offloaded step does for mixed precision);
- ``torch-foreach``: ``torch.optim.AdamW(foreach=True)``;
- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` (the kernel ``adam_step_`` calls);
- ``deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam`` (a C++ op it builds on first use, with
  ``DS_ACCELERATOR=cpu``); optional: if it is missing or fails to build, its row says why.

One optimizer exists at a time (each holds ~1.2 GB at the default size) and is freed before
the next. Each takes ``--warmup`` steps (state allocation, first touch of the moments), then
``--steps`` timed steps; the variants run ``--repeats`` rounds, in reverse order every other
round so that drift of the machine's speed does not favour one of them, and the median step
over all rounds is reported. The first round also compares every variant's parameters after
its steps with ``zerotrain``'s: ``zerotrain+bf16`` and ``torch-fused`` must be bitwise equal.

    OMP_NUM_THREADS=2 python benchmarks/cpu_adam.py
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from zerotrain.optim.cpu_adam import AdamHyper, adam_step_

VARIANTS = ("zerotrain", "zerotrain+bf16", "torch-foreach", "torch-fused", "deepspeed")
HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

Step = Callable[[int], None]  # takes the 1-based step number


def _torch_adamw(param: torch.Tensor, **kind: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [param],
        lr=HYPER.lr,
        betas=(HYPER.beta1, HYPER.beta2),
        eps=HYPER.eps,
        weight_decay=HYPER.weight_decay,
        **kind,
    )


def _deepspeed_adam(param: torch.Tensor) -> torch.optim.Optimizer:
    if importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError("deepspeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no CUDA here: its CPU accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(
        [param],
        lr=HYPER.lr,
        betas=(HYPER.beta1, HYPER.beta2),
        eps=HYPER.eps,
        weight_decay=HYPER.weight_decay,
        adamw_mode=True,
    )


def _build(variant: str, param: torch.Tensor, grad: torch.Tensor) -> Step:
    """A step function that updates ``param`` in place with ``variant``."""
    if variant.startswith("zerotrain"):
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        lowp = torch.empty_like(param, dtype=torch.bfloat16) if variant.endswith("bf16") else None

        def step(n: int) -> None:
            adam_step_(param, grad, exp_avg, exp_avg_sq, n, HYPER, lowp_out=lowp)

        return step
    param.grad = grad
    if variant == "torch-foreach":
        opt = _torch_adamw(param, foreach=True)
    elif variant == "torch-fused":
        opt = _torch_adamw(param, fused=True)
    elif variant == "deepspeed":
        opt = _deepspeed_adam(param)
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return lambda n: opt.step()


def _run(
    variant: str, start: torch.Tensor, grad: torch.Tensor, args: argparse.Namespace
) -> tuple[list[float], torch.Tensor]:
    """Time one variant's steps on a fresh copy of the shard; its final parameters too."""
    param = start.clone()
    step = _build(variant, param, grad)
    times = []
    for n in range(1, args.warmup + args.steps + 1):
        begin = time.perf_counter()
        step(n)
        if n > args.warmup:
            times.append(time.perf_counter() - begin)
    return times, param


def _reason(exc: BaseException) -> str:
    """One line for the table: the error and what caused it (a failed build says why)."""
    reason = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        reason += f" (caused by {type(cause).__name__}: {cause})"
    return " ".join(reason.split())[:300].replace("|", "/")


def _compare(param: torch.Tensor, ref: torch.Tensor) -> str:
    if torch.equal(param, ref):
        return "bitwise equal"
    return f"max abs diff {(param - ref).abs().max().item():.1e}"


def _measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(args.numel, generator=gen)
    grad = torch.randn(args.numel, generator=gen).mul_(1e-2)
    results: dict[str, dict[str, Any]] = {v: {"times": []} for v in args.variants}
    ref: torch.Tensor | None = None
    for round_ in range(args.repeats):
        order = args.variants if round_ % 2 == 0 else args.variants[::-1]
        for variant in order:
            result = results[variant]
            if "error" in result:
                continue
            try:
                times, param = _run(variant, start, grad, args)
            except Exception as exc:  # an optional peer that failed: report it, carry on
                result["error"] = _reason(exc)
                continue
            result["times"] += times
            if variant == "zerotrain" and ref is None:
                ref = param
            elif round_ == 0 and ref is not None:
                result["vs_zerotrain"] = _compare(param, ref)
            del param
            gc.collect()  # one optimizer's 1.2 GB at a time
    for result in results.values():
        if result["times"]:
            result["step_s"] = statistics.median(result["times"])
            result["mparams_per_s"] = args.numel / result["step_s"] / 1e6
    return results


def _print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base = results.get("zerotrain", {}).get("mparams_per_s")
    print(
        f"AdamW on {args.numel:,} fp32 parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.steps} steps x {args.repeats} "
        f"rounds after {args.warmup} warm-up steps"
    )
    print("| optimizer | M params/s | step ms | vs zerotrain | result vs zerotrain |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | n/a | n/a | n/a | not run: {r['error']} |")
            continue
        ratio = f"{r['mparams_per_s'] / base:.2f}x" if base else "n/a"
        print(
            f"| {name} | {r['mparams_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | {ratio} | "
            f"{r.get('vs_zerotrain', '(reference)' if name == 'zerotrain' else 'n/a')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4, help="rounds over the variants")
    parser.add_argument("--threads", type=int, help="torch/OpenMP threads (default: as set)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.threads:
        # DeepSpeed's op runs on torch's OpenMP runtime, so this sets its threads too.
        torch.set_num_threads(args.threads)
    results = _measure(args)
    _print_table(results, args)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        meta["threads"] = torch.get_num_threads()
        with open(args.json, "w") as f:
            json.dump({"args": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Progressive layer drop (PLD) and random-LTD on the demo GPT: time per step against the same
model without them, and PLD's loss at equal wall-clock time. 2 data-parallel ranks (gloo),
ZeRO stage 2, AdamW, clipping 1.0, real text (``zerotrain.examples.corpus``).

    OMP_NUM_THREADS=1 python benchmarks/training_efficiency.py \\
        --json /tmp/zt/training_efficiency.json --png benchmarks/training_efficiency_pld.png

``--quick`` (a small model, a few steps, a 6-s budget) is a smoke check of the whole script.

**Timing** (one job; every variant has its own engine in the same two ranks and they take
turns step by step, so drift of a shared machine's speed affects them alike):

- ``base``: the model as it is; ``pld``: ``progressive_layer_drop`` with theta 0.5 and
  gamma = 3 / ``--pld-steps`` (theta(t) = 0.5 exp(-gamma t) + 0.5), timed over its last
  ``repeats x window`` steps, where theta has come down to within ~0.08 of 0.5;
  ``ltd``: random-LTD with ``min_value = max_value / 2`` held (``require_steps`` 1e9) on every
  block but the first and the last; ``nonblock``: the same GPT with no blocks at all
  (embedding, final norm, tied head, loss, their optimizer step): the cost no dropping can
  remove.
- Each variant's time per step is the median over ``--repeats`` windows of ``--window``
  steps (each window's mean); ratios are the median of the per-window ratios. Each step is
  also split into the engine's wall-clock phases (``wall_clock_breakdown``): forward,
  backward (with the gradient reductions its hooks launch), grad_comm_wait (reductions
  launched after autograd) and step (clipping, AdamW, all-gather of the updated
  parameters); the ``comms_logger`` gives the time in the gradient reduce-scatters and the
  parameter all-gathers. "Compute" is forward + backward + grad_comm_wait less the
  reduce-scatters; "block compute" is a variant's compute less ``nonblock``'s.
- The time the step spends saving and restoring the state of parameters that got no
  gradient (``ZeroStrategy._untouched``: AdamW steps every shard, then the slices of the
  dropped layers are put back, as plain PyTorch skips a parameter without a gradient) is
  timed by wrapping that method (no library change).
- PLD's expected kept-layer fraction is the mean over layers of 1 - l/L (1 - theta(t)) over
  the measured forwards (``decision(i)``'s probability); the realised fraction counts the
  blocks that ran. Random-LTD's expected fraction of token-layer work is
  (2 + (L - 2) / 2) / L; FLOP-weighted, the attention scores of a kept-half block cost a
  quarter.

**Loss at equal wall-clock** (a second job): ``base`` and ``pld`` each train for ``--budget``
seconds of their own step time, taking turns (the one behind on its clock steps next), on
the same sequence of batches from the first 90% of the corpus; at ``--evals`` equally spaced
points of its clock each is evaluated (``model.eval()``: every block runs, unscaled) on the
same ``--eval-windows`` windows of the held-out last 10%. PLD's gamma is 3 / (the steps it
is expected to make in the budget, from the timing job). lr warms up linearly over
``--warmup`` steps, then stays constant (the runs make different numbers of steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("base", "pld", "ltd", "nonblock")
PHASES = ("forward", "backward", "grad_comm_wait", "step")
THETA = 0.5


def _windows(data: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length - 1, (count,), generator=gen)
    return data[starts[:, None] + torch.arange(length + 1)]


def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    from zerotrain.examples.corpus import load_corpus

    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    held_out = len(data) * 9 // 10  # the last tenth is only evaluated
    return data[:held_out], data[held_out:]


def _config(opts: dict[str, Any], world: int, extra: dict[str, Any]) -> dict[str, Any]:
    scheduler = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": opts["lr"],
            "warmup_num_steps": opts["warmup"],
            "warmup_type": "linear",
        },
    }
    return {
        "train_batch_size": opts["batch"] * world,
        "train_micro_batch_size_per_gpu": opts["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opts["lr"], "weight_decay": 0.01, "betas": [0.9, 0.95]},
        },
        "scheduler": scheduler,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True},
        **extra,
    }


def _pld_section(gamma: float) -> dict[str, Any]:
    return {"progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": gamma}}


def _ltd_section(opts: dict[str, Any]) -> dict[str, Any]:
    layers, seq = opts["layers"], opts["seq"]
    middle = list(range(1, layers - 1))
    return {
        "data_efficiency": {
            "enabled": True,
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": layers,
                    "random_ltd_layer_num": len(middle),
                    "random_ltd_layer_id": middle,
                    "model_type": "decoder",
                    "hidden_state_order": "batch_seq_dim",
                    "random_ltd_schedule": {
                        "min_value": seq // 2,
                        "max_value": seq,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 10**9, "seq_per_step": 8},
                    },
                },
            },
        }
    }


class _Trainee:
    """One engine on this rank, stepping through the global batches ``batches``."""

    def __init__(self, name: str, opts: dict[str, Any], layers: int, extra: dict[str, Any]):
        import torch.distributed as dist

        import zerotrain
        from zerotrain.examples.gpt import GPT, GPTConfig

        self.name = name
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg = GPTConfig(
            block_size=opts["seq"],
            n_layer=layers,
            n_head=opts["heads"],
            n_embd=opts["width"],
            dropout=0.0,
        )
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.layers = layers
        config = _config(opts, self.world, extra)
        self.engine, *_ = zerotrain.initialize(model=self.model, config=config)
        self.clock = self.engine.telemetry.wall_clock
        self.steps = 0
        self.elapsed = 0.0  # this trainee's own step time, summed (the equal-time runs)

    def _comm_seconds(self) -> tuple[float, float]:
        summary = self.engine.comm.comms_summary()
        return (
            summary.get("reduce_scatter", "gradients").total_s,
            summary.get("all_gather", "parameters").total_s,
        )

    def step(self, batches: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on this rank's part of global batch ``self.steps``."""
        before = dict(self.clock.seconds)
        comm_before = self._comm_seconds()
        untouched_before = dict(_UNTOUCHED)
        start = time.perf_counter()
        rows = batches[self.steps % len(batches)]
        b = len(rows) // self.world
        mine = rows[self.rank * b : (self.rank + 1) * b]
        loss = self.engine(mine[:, :-1], mine[:, 1:])
        pld = self.engine.efficiency.layer_drop if self.engine.efficiency else None
        decisions = [pld.decision(i) for i in range(self.layers)] if pld is not None else None
        self.engine.backward(loss)
        self.engine.step()
        seconds = time.perf_counter() - start
        self.steps += 1
        comm_after = self._comm_seconds()
        phases = {p: self.clock.seconds[p] - before[p] for p in PHASES}
        phases["reduce_scatter"] = comm_after[0] - comm_before[0]
        phases["all_gather"] = comm_after[1] - comm_before[1]
        phases["untouched"] = _UNTOUCHED["seconds"] - untouched_before["seconds"]
        record: dict[str, Any] = {
            "seconds": seconds,
            "loss": float(loss),
            "phases": phases,
            "unused_params": _UNTOUCHED["params"] - untouched_before["params"],
        }
        if decisions is not None:
            record["kept"] = sum(bool(k) for k, _ in decisions)
            record["expected"] = sum(p for _, p in decisions)
        return record

    def evaluate(self, windows: torch.Tensor, batch: int) -> float:
        """Mean loss over ``windows`` with every block (each rank takes its share)."""
        import torch.distributed as dist

        mine = windows[self.rank :: self.world]
        total = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad():
            for i in range(0, len(mine), batch):
                chunk = mine[i : i + batch]
                total[0] += float(self.model(chunk[:, :-1], chunk[:, 1:])) * len(chunk)
                total[1] += len(chunk)
        self.model.train()
        dist.all_reduce(total)
        return float(total[0] / total[1])


_UNTOUCHED = {"seconds": 0.0, "params": 0}


def _time_untouched() -> None:
    """Wrap ``ZeroStrategy._untouched`` (save before AdamW, restore after, the state of the
    parameters that got no gradient) to time it; a no-op if the library has no such method."""
    from zerotrain.zero.strategy import ZeroStrategy

    original = getattr(ZeroStrategy, "_untouched", None)
    if original is None or getattr(original, "_timed", False):
        return

    @contextlib.contextmanager
    def timed(self: Any, unused: list[Any], optimizer: Any) -> Any:
        start = time.perf_counter()
        inner = original(self, unused, optimizer)
        inner.__enter__()
        _UNTOUCHED["seconds"] += time.perf_counter() - start
        _UNTOUCHED["params"] += len(unused)
        try:
            yield
        except BaseException as exc:
            inner.__exit__(type(exc), exc, exc.__traceback__)
            raise
        start = time.perf_counter()
        inner.__exit__(None, None, None)
        _UNTOUCHED["seconds"] += time.perf_counter() - start

    timed._timed = True  # type: ignore[attr-defined]
    ZeroStrategy._untouched = timed  # type: ignore[method-assign]


def _timing(opts: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: the four variants, step by step."""
    _time_untouched()
    train, _ = _corpus()
    window, repeats = opts["window"], opts["repeats"]
    total_pld = opts["pld_steps"]
    batches = _windows(train, (total_pld + 8) * opts["batch"] * 2, opts["seq"], seed=1)
    batches = batches.view(total_pld + 8, opts["batch"] * 2, -1)
    gamma = 3.0 / total_pld
    trainees = {
        "base": _Trainee("base", opts, opts["layers"], {}),
        "pld": _Trainee("pld", opts, opts["layers"], _pld_section(gamma)),
        "ltd": _Trainee("ltd", opts, opts["layers"], _ltd_section(opts)),
        "nonblock": _Trainee("nonblock", opts, 0, {}),
    }
    # Warm-up: PLD up to its late phase, the others a few steps each.
    for name, trainee in trainees.items():
        for _ in range(total_pld - repeats * window if name == "pld" else opts["warmup_steps"]):
            trainee.step(batches)
    thetas_before = trainees["pld"].engine.get_pld_theta()
    # Windows: the variants take turns step by step (the order rotating), so each window of
    # each variant covers the same stretch of time as the others' (a shared machine's load
    # changes within seconds).
    records: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in trainees}
    names = list(trainees)
    turn = 0
    for _ in range(repeats):
        for name in names:
            records[name].append([])
        for _ in range(window):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                records[name][-1].append(trainees[name].step(batches))
            turn += 1
    return {
        "records": records,
        "gamma": gamma,
        "theta_first_measured": thetas_before,
        "theta_last": trainees["pld"].engine.get_pld_theta(),
        "params": {n: t.model.num_parameters() for n, t in trainees.items()},
    }


def _equal_time(opts: dict[str, Any], gamma: float) -> dict[str, Any]:
    """Runs on every rank: base and PLD for ``budget`` seconds each of their own step time."""
    import torch.distributed as dist

    train, held = _corpus()
    budget, evals = opts["budget"], opts["evals"]
    world = dist.get_world_size()
    count = opts["max_steps"]
    batches = _windows(train, count * opts["batch"] * world, opts["seq"], seed=3)
    batches = batches.view(count, opts["batch"] * world, -1)
    held_windows = _windows(held, opts["eval_windows"], opts["seq"], seed=4)
    trainees = {
        "base": _Trainee("base", opts, opts["layers"], {}),
        "pld": _Trainee("pld", opts, opts["layers"], _pld_section(gamma)),
    }
    marks = [budget * k / evals for k in range(evals + 1)]
    out: dict[str, dict[str, list[Any]]] = {
        name: {"steps": [], "evals": [], "thetas": []} for name in trainees
    }
    for name, trainee in trainees.items():
        out[name]["evals"].append([0.0, 0, trainee.evaluate(held_windows, opts["batch"])])
    next_mark = dict.fromkeys(trainees, 1)
    while True:
        live = [t for t in trainees.values() if next_mark[t.name] <= evals]
        if not live:
            break
        trainee = min(live, key=lambda t: t.elapsed)
        record = trainee.step(batches)
        agreed = torch.tensor([record["seconds"], record["loss"]], dtype=torch.float64)
        dist.all_reduce(agreed)  # the same clock on both ranks, so both pick the same trainee
        trainee.elapsed += float(agreed[0]) / world
        entry = [trainee.elapsed, trainee.steps, float(agreed[1]) / world]
        out[trainee.name]["steps"].append(entry)
        if trainee.name == "pld":
            out["pld"]["thetas"].append(trainee.engine.get_pld_theta())
        while (
            next_mark[trainee.name] <= evals and trainee.elapsed >= marks[next_mark[trainee.name]]
        ):
            loss = trainee.evaluate(held_windows, opts["batch"])
            out[trainee.name]["evals"].append([trainee.elapsed, trainee.steps, loss])
            next_mark[trainee.name] += 1
    return {"runs": out, "marks": marks, "gamma": gamma}


# -- summaries -----------------------------------------------------------------------------------


KEYS = (
    "seconds", "forward", "backward", "grad_comm_wait", "step", "reduce_scatter", "all_gather",
    "untouched", "compute",
)  # fmt: skip


def _value(step: dict[str, Any], key: str) -> float:
    if key == "seconds":
        return step["seconds"]
    ph = step["phases"]
    if key == "compute":  # forward and backward without the gradient reductions
        return ph["forward"] + ph["backward"] + ph["grad_comm_wait"] - ph["reduce_scatter"]
    return ph[key]


def _window_means(windows: list[list[dict[str, Any]]], key: str) -> list[float]:
    return [statistics.mean(_value(s, key) for s in w) for w in windows]


def _summarise_timing(result: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    layers = opts["layers"]
    records = result["records"]
    means = {name: {k: _window_means(records[name], k) for k in KEYS} for name in records}
    med = {name: {k: statistics.median(v) for k, v in m.items()} for name, m in means.items()}
    base, nb = means["base"], means["nonblock"]

    def ratio(name: str, key: str) -> float:
        """Median over windows of the variant's / base's window mean."""
        return statistics.median(a / b for a, b in zip(means[name][key], base[key], strict=True))

    def block_ratio(name: str) -> float:
        """Median over windows of the variant's block compute / base's."""
        m = means[name]
        return statistics.median(
            (a - n) / (b - n)
            for a, b, n in zip(m["compute"], base["compute"], nb["compute"], strict=True)
        )

    pld_steps = [s for w in records["pld"] for s in w]
    expected = statistics.mean(s["expected"] for s in pld_steps) / layers
    realised = statistics.mean(s["kept"] for s in pld_steps) / layers
    mb, mp, ml, mn = med["base"], med["pld"], med["ltd"], med["nonblock"]
    block_base = mb["compute"] - mn["compute"]
    # The step if only the blocks' forward and backward shrank (by the realised fraction):
    # non-block work, gradient reductions, AdamW and the all-gather unchanged.
    ideal_pld = mb["seconds"] - block_base * (1 - realised)
    step_ratio = ratio("pld", "seconds")
    ltd_token_frac = (2 + (layers - 2) * 0.5) / layers
    c, t = opts["width"], opts["seq"]
    linear, attention = 24 * t * c * c, 4 * t * t * c  # matmul FLOPs of one block's forward
    ltd_layer_flops = (linear * 0.5 + attention * 0.25) / (linear + attention)
    ltd_flop_frac = (2 + (layers - 2) * ltd_layer_flops) / layers
    ideal_ltd = mb["seconds"] - block_base * (1 - ltd_flop_frac)
    return {
        "median": med,
        "window_seconds": {name: m["seconds"] for name, m in means.items()},
        "pld": {
            "gamma": result["gamma"],
            "theta_range": [result["theta_first_measured"], result["theta_last"]],
            "expected_kept": expected,
            "realised_kept": realised,
            "step_ratio": step_ratio,
            "step_ratio_vs_expected": step_ratio / expected,
            "within_10pct": abs(step_ratio - expected) <= 0.10 * expected,
            "block_ratio": block_ratio("pld"),
            "step_phase_ratio": ratio("pld", "step"),
            "ideal_step_ratio": ideal_pld / mb["seconds"],
            "extra_ms": 1000 * (mp["seconds"] - ideal_pld),
            "unused_params_per_step": statistics.mean(s["unused_params"] for s in pld_steps),
        },
        "ltd": {
            "kept_tokens": opts["seq"] // 2,
            "token_layer_frac": ltd_token_frac,
            "flop_frac": ltd_flop_frac,
            "step_ratio": ratio("ltd", "seconds"),
            "block_ratio": block_ratio("ltd"),
            "ideal_step_ratio": ideal_ltd / mb["seconds"],
            "extra_ms": 1000 * (ml["seconds"] - ideal_ltd),
        },
        "nonblock_share": mn["seconds"] / mb["seconds"],
        "block_share": block_base / mb["seconds"],
        "params": result["params"],
    }


def _print_timing(s: dict[str, Any], opts: dict[str, Any]) -> None:
    med = s["median"]
    print(
        f"\n{opts['layers']}-block GPT, width {opts['width']}, {opts['heads']} heads, seq "
        f"{opts['seq']}, micro-batch {opts['batch']}/rank, {s['params']['base'] / 1e6:.2f}M "
        f"parameters; 2 ranks, ZeRO-2; median of {opts['repeats']} windows of "
        f"{opts['window']} steps (ms per step)\n"
    )
    print(
        "| variant | step | vs base | forward | backward | grad_comm_wait | step phase | "
        "grad reduce-scatter | param all-gather | untouched save/restore | compute | "
        "block compute |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"base": 1.0, "pld": s["pld"]["step_ratio"], "ltd": s["ltd"]["step_ratio"]}
    nb = med["nonblock"]["compute"]
    for name, m in med.items():
        r = ratios.get(name, m["seconds"] / med["base"]["seconds"])
        cells = [m[k] for k in KEYS[1:]] + [m["compute"] - nb if name != "nonblock" else 0.0]
        print(
            f"| {name} | {1000 * m['seconds']:.1f} | {r:.3f} | "
            + " | ".join(f"{1000 * v:.1f}" for v in cells)
            + " |"
        )
    p, ltd = s["pld"], s["ltd"]
    print(
        f"\nPLD: theta {p['theta_range'][0]:.3f} -> {p['theta_range'][1]:.3f} over the measured "
        f"steps (gamma {p['gamma']:.4g}); kept-layer fraction expected {p['expected_kept']:.3f}, "
        f"realised {p['realised_kept']:.3f}; step ratio {p['step_ratio']:.3f} = "
        f"{p['step_ratio_vs_expected']:.3f} x expected "
        f"({'within' if p['within_10pct'] else 'NOT within'} 10%); block compute ratio "
        f"{p['block_ratio']:.3f}; step-phase ratio {p['step_phase_ratio']:.3f}; ratio if only "
        f"block compute shrank {p['ideal_step_ratio']:.3f} (measured is {p['extra_ms']:+.1f} ms "
        f"from it); {p['unused_params_per_step']:.1f} parameters without gradient per step"
    )
    print(
        f"random-LTD: {ltd['kept_tokens']} of {opts['seq']} tokens in layers "
        f"1..{opts['layers'] - 2}; token-layer fraction {ltd['token_layer_frac']:.3f} "
        f"(FLOP-weighted {ltd['flop_frac']:.3f}); step ratio {ltd['step_ratio']:.3f}; "
        f"block compute ratio {ltd['block_ratio']:.3f}; ratio if only block compute shrank "
        f"by the FLOP-weighted fraction {ltd['ideal_step_ratio']:.3f} ({ltd['extra_ms']:+.1f} ms)"
    )
    print(
        f"base step: non-block model {s['nonblock_share']:.3f}, block compute "
        f"{s['block_share']:.3f} of it",
        flush=True,
    )


def _summarise_equal_time(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["runs"]
    summary: dict[str, Any] = {"marks": result["marks"], "gamma": result["gamma"]}
    for name, run in runs.items():
        summary[name] = {
            "steps": run["steps"][-1][1],
            "elapsed": run["steps"][-1][0],
            "final_eval": run["evals"][-1][2],
            "evals": run["evals"],
            "train_last20": statistics.mean(s[2] for s in run["steps"][-20:]),
        }
    thetas = runs["pld"]["thetas"]
    summary["pld"]["theta_last"] = thetas[-1] if thetas else None
    summary["eval_ratio"] = summary["pld"]["final_eval"] / summary["base"]["final_eval"]
    return summary


def _print_equal_time(s: dict[str, Any]) -> None:
    print("\n| clock mark s | base: s, step, eval loss | pld: s, step, eval loss | pld - base |")
    print("|---|---|---|---|")
    for k, mark in enumerate(s["marks"]):
        b, p = s["base"]["evals"][k], s["pld"]["evals"][k]
        print(
            f"| {mark:.0f} | {b[0]:.1f}, {b[1]}, {b[2]:.4f} | {p[0]:.1f}, {p[1]}, {p[2]:.4f} | "
            f"{p[2] - b[2]:+.4f} |"
        )
    print(
        f"\nat the budget: base {s['base']['final_eval']:.4f} ({s['base']['steps']} steps), PLD "
        f"{s['pld']['final_eval']:.4f} ({s['pld']['steps']} steps, final theta "
        f"{s['pld']['theta_last']:.3f}, gamma {s['gamma']:.4g}); ratio {s['eval_ratio']:.4f}",
        flush=True,
    )


def _plot(runs: dict[str, Any], summary: dict[str, Any], opts: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color, label in (("base", "k", "all layers"), ("pld", "C0", "PLD (theta 0.5)")):
        steps = np.asarray(runs[name]["steps"])
        evals = np.asarray(runs[name]["evals"])
        k = 10 if len(steps) > 40 else 1
        smooth = np.convolve(steps[:, 2], np.ones(k) / k, mode="valid")
        final = summary[name]["final_eval"]
        for ax, col in ((axes[0], 0), (axes[1], 1)):
            ax.plot(steps[k - 1 :, col], smooth, color=color, lw=0.8, alpha=0.45)
            ax.plot(
                evals[:, col],
                evals[:, 2],
                "o-",
                color=color,
                ms=3.5,
                lw=1.4,
                label=f"{label}: held-out {final:.3f} ({summary[name]['steps']} steps)",
            )
    axes[0].set_xlabel("training wall-clock (s, own step time)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lo = min(min(e[2] for e in runs[n]["evals"]) for n in runs)
    for ax in axes:
        ax.set_ylim(lo - 0.1, lo + 1.2)
    fig.suptitle(
        f"{opts['layers']}-block GPT (width {opts['width']}), 2 ranks, ZeRO-2, CPU: progressive "
        f"layer drop vs all layers, {opts['budget']:.0f} s each. Dots: held-out loss (every "
        "block runs); faint: training loss (10-step mean)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from zerotrain.testing.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, seconds: smoke check")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30, help="lr warm-up steps")
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (not PLD)")
    parser.add_argument(
        "--pld-steps", type=int, default=125, help="PLD's timing run (gamma = 3 / this)"
    )
    parser.add_argument("--budget", type=float, default=180.0, help="seconds per run (loss)")
    parser.add_argument("--evals", type=int, default=12, help="held-out evaluations per run")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument(
        "--pld-step-s",
        type=float,
        default=0.65,
        help="PLD's late step time, for gamma, when --parts has no timing",
    )
    parser.add_argument("--parts", default="timing,loss")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.heads, args.batch = 6, 64, 2, 4
        args.window, args.repeats, args.warmup_steps, args.pld_steps = 2, 2, 1, 8
        args.budget, args.evals, args.eval_windows, args.warmup = 6.0, 3, 16, 2
    opts: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "layers", "width", "heads", "seq", "batch", "lr", "warmup", "window", "repeats",
            "warmup_steps", "pld_steps", "budget", "evals", "eval_windows",
        )
    }  # fmt: skip
    parts = args.parts.split(",")
    results: dict[str, Any] = {"options": opts}
    pld_step_s = None
    if "timing" in parts:
        budget_s = 60 * 60
        timing = run_distributed(_timing, 2, opts, timeout=budget_s, comm_timeout=600)[0]
        summary = _summarise_timing(timing, opts)
        results["timing"] = {"summary": summary, "records": timing["records"]}
        _print_timing(summary, opts)
        pld_step_s = summary["median"]["pld"]["seconds"]
    if "loss" in parts:
        if pld_step_s is None:
            pld_step_s = args.pld_step_s
        expected_steps = max(1, round(args.budget / pld_step_s))
        gamma = 3.0 / expected_steps
        opts["max_steps"] = 4 * expected_steps + 100  # batches to draw (a bound, not a target)
        timeout = 4 * args.budget + 1200
        run = run_distributed(_equal_time, 2, opts, gamma, timeout=timeout, comm_timeout=600)[0]
        summary = _summarise_equal_time(run)
        summary["expected_pld_steps"] = expected_steps
        results["equal_time"] = {"summary": summary, "runs": run["runs"]}
        _print_equal_time(summary)
        if args.png:
            _plot(run["runs"], summary, opts, args.png)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if not math.isfinite(results.get("equal_time", {}).get("summary", {}).get("eval_ratio", 0.0)):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()

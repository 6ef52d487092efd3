"""``zerotrain lr-find``: run DeepSpeed's LR range test on a training script and suggest a
learning-rate range.

The script is launched as ``zerotrain run`` would launch it, with one change made inside
``zerotrain.initialize``: the config's ``scheduler`` becomes ``LRRangeTest``, rising
linearly from ``--min-lr`` to ``--max-lr`` over ``--steps`` optimizer steps. The job stops
itself after the last step or as soon as the loss diverges; then the recorded curve is
plotted and a range is suggested (:func:`zerotrain.optim.lr_finder.suggest_lr_range`),
with a OneCycle ``scheduler`` section to paste into the config.

DeepSpeed's sweep is linear in the lr, so most of its steps lie in the top decade of the
range: the points are about ``max_lr / steps`` apart. The defaults cover 1e-5 to 1e-2,
where Adam's learning rates live; for SGD, or for a finer look at a lower decade, change
``--max-lr``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zerotrain.cli import run as run_cmd
from zerotrain.engine.lr_find import LRFindRequest, read_records
from zerotrain.optim.lr_finder import (
    DEFAULT_DIVERGENCE_FACTOR,
    DEFAULT_SMOOTHING,
    MAX_LR_DIVISOR,
    MIN_LR_DIVISOR,
    LRRecord,
    LRSuggestion,
    plot_lr_range,
    suggest_lr_range,
)

RECORDS = "lr_range_test.jsonl"
PLOT = "lr_range_test.png"
RESULT = "lr_range_test.json"

_NO_RECORDS = (
    "zerotrain lr-find: the script recorded no optimizer step. It must build its engine "
    "with zerotrain.initialize (in the launched process) and train with engine(batch), "
    "engine.backward(loss), engine.step(); the pipeline engine's train_batch() is not "
    "supported yet."
)


def add_lr_find_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zerotrain lr-find``."""
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes (default: GPUs on this node, else 1)",
    )
    parser.add_argument("--min-lr", type=float, default=1e-5, help="lr of the first step")
    parser.add_argument("--max-lr", type=float, default=1e-2, help="lr of the last step")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep")
    parser.add_argument(
        "--step-size",
        type=int,
        default=1,
        help="steps per lr interval (lr_range_test_step_size; default 1)",
    )
    parser.add_argument(
        "--staircase",
        action="store_true",
        help="hold the lr for whole intervals of --step-size steps",
    )
    parser.add_argument(
        "--divergence-factor",
        type=float,
        default=DEFAULT_DIVERGENCE_FACTOR,
        help="stop once the smoothed loss exceeds this multiple of its best (default 4)",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        default=DEFAULT_SMOOTHING,
        help="beta of the loss's moving average (default 0.9; 0 = raw losses)",
    )
    parser.add_argument("--out", default="lr_find", help="where the plot and data go")
    parser.add_argument(
        "-m", "--module", action="store_true", help="treat the target as a module name"
    )
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")


def make_request(args: argparse.Namespace, record_path: Path) -> LRFindRequest:
    """The sweep the options describe: ``step_rate`` is chosen so that the last step runs
    at exactly ``--max-lr`` (up to rounding).

    Raises:
        ValueError: an option out of range, naming it and what is allowed.
    """
    if not (args.min_lr > 0 and math.isfinite(args.max_lr) and args.max_lr > args.min_lr):
        raise ValueError(
            f"--min-lr {args.min_lr:g} and --max-lr {args.max_lr:g}: need 0 < min < max"
        )
    if args.step_size < 1:
        raise ValueError(f"--step-size must be >= 1, got {args.step_size}")
    intervals = (args.steps - 1) / args.step_size
    if args.staircase:
        intervals = math.floor(intervals)
    if intervals <= 0:
        raise ValueError(
            f"--steps {args.steps} leaves no room to raise the lr: need --steps > 1 "
            f"(with --staircase, > --step-size {args.step_size})"
        )
    return LRFindRequest(
        min_lr=args.min_lr,
        step_rate=(args.max_lr / args.min_lr - 1.0) / intervals,
        step_size=args.step_size,
        staircase=args.staircase,
        max_steps=args.steps,
        record_path=str(record_path),
        divergence_factor=args.divergence_factor,
        smoothing=args.smoothing,
    )


def _launch(args: argparse.Namespace, request: LRFindRequest) -> int:
    """Run the script as ``zerotrain run`` does, with the request in the environment."""
    launch = run_cmd.local_launch(
        args.nproc_per_node, args.script, args.script_args, args.module, "zerotrain-lr-find"
    )
    saved = os.environ.copy()
    os.environ.update(request.to_env())
    try:
        return run_cmd.run(launch)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def onecycle_section(suggestion: LRSuggestion) -> dict[str, Any]:
    """A OneCycle ``scheduler`` section over the suggested range (DeepSpeed's keys)."""
    return {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": _round(suggestion.min_lr),
            "cycle_max_lr": _round(suggestion.max_lr),
        },
    }


def _summary(records: list[LRRecord], stopped: str | None, returncode: int) -> list[str]:
    steps = f"{len(records)} steps recorded, lr {records[0].lr:.3g} to {records[-1].lr:.3g}"
    if stopped is not None:
        return [f"{stopped}; {steps}"]
    if returncode != 0:
        return [
            f"LR range test: the job failed (its error is above) after {steps}; the "
            "suggestion uses the steps recorded before the failure"
        ]
    return [
        f"LR range test: the script ended before the sweep did (it trains fewer steps than "
        f"--steps, so the lr never reached --max-lr); {steps}"
    ]


def _suggestion_lines(suggestion: LRSuggestion) -> list[str]:
    snippet = json.dumps({"scheduler": onecycle_section(suggestion)}, indent=2)
    return [
        f"lowest smoothed loss {suggestion.min_loss:.4g} at lr {suggestion.lr_at_min_loss:.3g}; "
        f"steepest descent at lr {suggestion.steepest_lr:.3g}",
        f"suggested lr range: {suggestion.min_lr:.3g} to {suggestion.max_lr:.3g} (max = lr "
        f"at the lowest loss / {MAX_LR_DIVISOR:g}, min = max / {MIN_LR_DIVISOR:g})",
        *(f"note: {note}" for note in suggestion.notes),
        "OneCycle schedule for the config (set cycle_first_step_size, default 2000, to "
        "about half the run's steps):",
        snippet[1:-1].strip("\n"),
    ]


def report(
    request: LRFindRequest, out: Path, returncode: int, plot: bool = True
) -> tuple[int, list[str]]:
    """Read the records, write ``out/lr_range_test.json`` (and the PNG), and return the
    exit code and the lines to print.

    Args:
        request: the sweep that ran.
        out: the output folder, holding the records.
        returncode: the job's exit code.
        plot: write the PNG (needs matplotlib).
    """
    records, stopped = read_records(request.record_path)
    if not records and returncode != 0:
        return returncode, [
            "zerotrain lr-find: the job failed before its first optimizer step (its error is above)"
        ]
    if not records:
        return 1, [_NO_RECORDS]
    lines = _summary(records, stopped, returncode)
    suggestion: LRSuggestion | None = None
    error: str | None = None
    try:
        suggestion = suggest_lr_range(
            [r.lr for r in records],
            [r.loss for r in records],
            smoothing=request.smoothing,
            divergence_factor=request.divergence_factor,
        )
    except ValueError as err:
        error = str(err)
        lines.append(f"zerotrain lr-find: no suggestion: {error}")
    result = {
        "request": {k: v for k, v in asdict(request).items() if k != "record_path"},
        "records": [r.to_json() for r in records],
        "stopped": stopped,
        "suggestion": suggestion.to_json() if suggestion is not None else None,
        "scheduler": onecycle_section(suggestion) if suggestion is not None else None,
        "error": error,
    }
    (out / RESULT).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if suggestion is not None:
        lines += _suggestion_lines(suggestion)
    if plot:
        try:
            plot_lr_range(records, suggestion, out / PLOT)
            lines.append(f"plot: {out / PLOT}; data: {out / RESULT}")
        except ImportError as err:
            lines.append(f"{err}; data: {out / RESULT}")
    ok = suggestion is not None and (stopped is not None or returncode == 0)
    return (0 if ok else returncode or 1), lines


def run_lr_find(args: argparse.Namespace) -> int:
    """``zerotrain lr-find``: launch, then analyse. Returns the exit code: 0 with a
    suggestion, 1 without one or when the job failed, 2 for bad options."""
    out = Path(args.out).resolve()
    try:
        request = make_request(args, out / RECORDS)
    except ValueError as err:
        print(f"zerotrain lr-find: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in (RECORDS, PLOT, RESULT):  # never show a previous run's results
        (out / name).unlink(missing_ok=True)
    print(
        f"zerotrain lr-find: lr from {args.min_lr:g} to {args.max_lr:g} over {args.steps} "
        f"steps (LRRangeTest step_rate {request.step_rate:.6g}, step_size "
        f"{request.step_size}{', staircase' if request.staircase else ''})",
        flush=True,
    )
    returncode = _launch(args, request)
    code, lines = report(request, out, returncode)
    print("\n".join(lines), file=sys.stdout if code == 0 else sys.stderr)
    return code

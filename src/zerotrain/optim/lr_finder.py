"""What an LR range test measured, and the learning-rate range it suggests.

The test (Leslie Smith, "Cyclical Learning Rates for Training Neural Networks", 2017, §3.3)
trains for a short while with a learning rate that grows every step and records the loss.
The loss first barely moves (the lr is too small to matter), then falls steeply, flattens at
its minimum and finally blows up. The largest lr worth training with lies in the steep part,
below the minimum: at the minimum the steps are already so large that they stop improving
the loss.

Mini-batch losses are noisy, so the curve is smoothed first with a bias-corrected
exponential moving average, the way fastai's ``lr_find`` does; points after the smoothed
loss has left ``divergence_factor`` x its best are ignored (fastai's stopping rule).

Everything here is plain Python on lists of floats: no torch, no ranks, so the rule can be
tested on curves whose answer is known. ``plot_lr_range`` needs matplotlib (the ``demo``
extra).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# fastai smooths with 0.98 over a 100-step *exponential* sweep. Its average lag,
# beta / (1 - beta) = 49 steps, is half the sweep; in DeepSpeed's *linear* sweep half the
# steps are half the lr range, so that lag would move the minimum by up to 2x. 0.9 lags about
# 9 steps and still divides the variance of the noise by (1 + beta) / (1 - beta) = 19.
DEFAULT_SMOOTHING = 0.9
# fastai's and DeepSpeed's tutorials' stopping rule: the smoothed loss at 4x its best has
# diverged; nothing after it says anything about good learning rates.
DEFAULT_DIVERGENCE_FACTOR = 4.0
# The minimum of the smoothed loss is where training stops improving: the edge of
# instability, pushed further right by the smoothing lag. fastai's rule, one decade below it,
# lands in the steep descent Smith recommends taking the maximum from.
MAX_LR_DIVISOR = 10.0
# Smith (2017, §3.3): "set base_lr to 1/3 or 1/4 of max_lr"; for 1Cycle he uses 1/3 to 1/10.
# 1/4 keeps the cycle's start in the region where the loss already falls.
MIN_LR_DIVISOR = 4.0
# Fewer points cannot show a descent and a minimum.
MIN_POINTS = 5


@dataclass(frozen=True)
class LRRecord:
    """One optimizer step of a range test.

    Attributes:
        step: the optimizer step, counted from 1.
        lr: the learning rate that step used (first param group).
        loss: the step's loss averaged over its micro-batches and the data-parallel ranks
            (inf or NaN once training has blown up).
    """

    step: int
    lr: float
    loss: float

    def to_json(self) -> dict[str, Any]:
        """A JSON object; a non-finite loss is written as null (JSON has no NaN)."""
        loss = self.loss if math.isfinite(self.loss) else None
        return {"step": self.step, "lr": self.lr, "loss": loss}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> LRRecord:
        """Inverse of :meth:`to_json` (a null loss becomes NaN)."""
        loss = obj.get("loss")
        return LRRecord(int(obj["step"]), float(obj["lr"]), math.nan if loss is None else loss)


@dataclass(frozen=True)
class LRSuggestion:
    """The learning-rate range a range test suggests, and the evidence for it.

    Attributes:
        min_lr: where a 1Cycle schedule should start and end (``max_lr / MIN_LR_DIVISOR``,
            never below the smallest lr tested).
        max_lr: the cycle's peak (``lr_at_min_loss / MAX_LR_DIVISOR``, never below the
            smallest lr tested).
        lr_at_min_loss: the lr where the smoothed loss was lowest.
        min_loss: that lowest smoothed loss.
        steepest_lr: the lr where the smoothed loss fell fastest per unit of log(lr)
            (fastai's "steep" suggestion): a second opinion on ``max_lr``.
        lrs: the learning rates used (the points before divergence).
        smoothed: the smoothed losses at those points.
        diverged: True when points were cut because the loss diverged.
        notes: what the user should know about the result (e.g. the loss was still falling
            at the largest lr tried).
    """

    min_lr: float
    max_lr: float
    lr_at_min_loss: float
    min_loss: float
    steepest_lr: float
    lrs: tuple[float, ...]
    smoothed: tuple[float, ...]
    diverged: bool
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON object of every field."""
        return {
            "min_lr": self.min_lr,
            "max_lr": self.max_lr,
            "lr_at_min_loss": self.lr_at_min_loss,
            "min_loss": self.min_loss,
            "steepest_lr": self.steepest_lr,
            "lrs": list(self.lrs),
            "smoothed": list(self.smoothed),
            "diverged": self.diverged,
            "notes": list(self.notes),
        }


class LossSmoother:
    """Bias-corrected exponential moving average of a loss, and the divergence test.

    The engine's recorder and :func:`suggest_lr_range` share it, so the run stops exactly
    where the suggestion stops reading.
    """

    def __init__(
        self,
        beta: float = DEFAULT_SMOOTHING,
        divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR,
    ) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {beta}")
        if not divergence_factor > 1.0:
            raise ValueError(f"divergence_factor must be > 1, got {divergence_factor}")
        self.beta = beta
        self.divergence_factor = divergence_factor
        self._average = 0.0
        self._count = 0
        self.best = math.inf

    def add(self, loss: float) -> float:
        """Fold ``loss`` in and return the smoothed value (the EMA over ``1 - beta**n``, so
        the first values are not pulled towards the zero the average starts from)."""
        self._count += 1
        self._average = self.beta * self._average + (1.0 - self.beta) * loss
        return self._average / (1.0 - self.beta**self._count)

    def diverged(self, smoothed: float) -> bool:
        """True when ``smoothed`` is not finite or above ``divergence_factor`` x the best
        smoothed loss so far; otherwise it becomes part of the best. The ratio means
        nothing for a best loss <= 0, so only non-finite values count there."""
        if not math.isfinite(smoothed):
            return True
        if self.best > 0.0 and smoothed > self.divergence_factor * self.best:
            return True
        self.best = min(self.best, smoothed)
        return False


def _check_inputs(lrs: Sequence[float], losses: Sequence[float]) -> None:
    if len(lrs) != len(losses):
        raise ValueError(f"got {len(lrs)} learning rates but {len(losses)} losses")
    if len(lrs) < MIN_POINTS:
        raise ValueError(
            f"an LR range test needs at least {MIN_POINTS} steps to show a descent and a "
            f"minimum, got {len(lrs)}"
        )
    for k, lr in enumerate(lrs):
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning rate #{k} is {lr}; every lr must be positive and finite")
        if k and lr < lrs[k - 1]:
            raise ValueError(
                f"learning rate #{k} ({lr:g}) is below #{k - 1} ({lrs[k - 1]:g}): a range "
                "test's lr must not decrease"
            )


def _smooth_until_divergence(
    losses: Sequence[float], beta: float, divergence_factor: float
) -> tuple[list[float], bool]:
    """The smoothed losses before divergence, and whether the curve diverged."""
    smoother = LossSmoother(beta, divergence_factor)
    kept: list[float] = []
    for loss in losses:
        smoothed = smoother.add(loss) if math.isfinite(loss) else math.nan
        if smoother.diverged(smoothed):
            return kept, True
        kept.append(smoothed)
    return kept, False


def _steepest(lrs: Sequence[float], smoothed: Sequence[float], last: int) -> float:
    """The lr at the start of the segment where the smoothed loss falls fastest per unit of
    log(lr), among the segments up to index ``last`` (fastai's ``steep``). Segments of equal
    lrs (steps skipped for a gradient overflow) have no slope and are passed over."""
    best_slope, best_lr = math.inf, lrs[0]
    for k in range(min(last, len(lrs) - 1)):
        run = math.log(lrs[k + 1]) - math.log(lrs[k])
        if run <= 0:
            continue
        slope = (smoothed[k + 1] - smoothed[k]) / run
        if slope < best_slope:
            best_slope, best_lr = slope, lrs[k]
    return best_lr


def suggest_lr_range(
    lrs: Sequence[float],
    losses: Sequence[float],
    *,
    smoothing: float = DEFAULT_SMOOTHING,
    divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR,
) -> LRSuggestion:
    """Suggest a learning-rate range from an LR range test.

    The loss is smoothed (bias-corrected EMA, ``smoothing`` = its beta) and cut where it
    diverges (non-finite, or above ``divergence_factor`` x its best). ``max_lr`` is the lr
    of the lowest smoothed loss divided by ``MAX_LR_DIVISOR``; ``min_lr`` is ``max_lr /
    MIN_LR_DIVISOR``; both are kept inside the tested range.

    Args:
        lrs: the learning rate of each step, positive and non-decreasing.
        losses: the loss of each step (inf/NaN allowed: they mark divergence).
        smoothing: the EMA's beta in [0, 1); 0 uses the raw losses.
        divergence_factor: above this multiple of the best smoothed loss, the curve has
            diverged (> 1).

    Returns:
        The suggestion, with the points it used.

    Raises:
        ValueError: fewer than ``MIN_POINTS`` steps (in all, or before divergence), lrs
            that are not positive or that decrease, or a loss that never fell below its
            first value.
    """
    _check_inputs(lrs, losses)
    smoothed, diverged = _smooth_until_divergence(losses, smoothing, divergence_factor)
    used = list(lrs[: len(smoothed)])
    if len(smoothed) < MIN_POINTS:
        raise ValueError(
            f"the loss diverged after {len(smoothed)} step(s), at lr {lrs[len(smoothed)]:g}; "
            f"at least {MIN_POINTS} steps before divergence are needed: the sweep rises too "
            "fast, lower its maximum lr (or give it more steps)"
        )
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    if best == 0:
        raise ValueError(
            f"the smoothed loss never fell below its first value ({smoothed[0]:.4g}) over "
            f"{len(smoothed)} steps, lr {used[0]:g} to {used[-1]:g}: either every lr tried "
            "is already too large (lower the sweep's minimum lr) or the model does not "
            "learn (check that the loss depends on the trained parameters)"
        )
    lowest = used[0]
    max_lr = max(used[best] / MAX_LR_DIVISOR, lowest)
    min_lr = max(max_lr / MIN_LR_DIVISOR, lowest)
    return LRSuggestion(
        min_lr=min_lr,
        max_lr=max_lr,
        lr_at_min_loss=used[best],
        min_loss=smoothed[best],
        steepest_lr=_steepest(used, smoothed, best),
        lrs=tuple(used),
        smoothed=tuple(smoothed),
        diverged=diverged,
        notes=_notes(used, best, diverged, max_lr),
    )


def _notes(lrs: list[float], best: int, diverged: bool, max_lr: float) -> tuple[str, ...]:
    """Warnings about how far to trust the suggestion, each with what to change."""
    notes: list[str] = []
    if best == len(lrs) - 1 and not diverged:
        notes.append(
            f"the loss was still falling at the largest lr tried ({lrs[-1]:g}): the best "
            "range may lie higher; rerun with a larger maximum lr"
        )
    if max_lr < lrs[1]:
        # A linear sweep (DeepSpeed's) leaves a gap of max/steps above its first lr.
        raised = f", raised to the smallest lr tried ({lrs[0]:g})" if max_lr == lrs[0] else ""
        notes.append(
            f"the suggested range lies below the second lr tried ({lrs[1]:g}), where the "
            f"sweep has no points{raised}: rerun with a maximum lr of about "
            f"{2 * lrs[best]:.2g} (twice the lr of the lowest loss) for a finer view"
        )
    return tuple(notes)


def plot_lr_range(
    records: Sequence[LRRecord], suggestion: LRSuggestion | None, path: str | os.PathLike[str]
) -> None:
    """Write the range test's curve as a PNG: loss against lr (log scale), raw and smoothed,
    with the suggested range shaded.

    Args:
        records: every step of the test (non-finite losses are left out of the plot).
        suggestion: the range to shade, or None (the curve alone).
        path: the PNG to write.

    Raises:
        ImportError: matplotlib is not installed (it comes with ``zerotrain[demo]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "plotting the LR range test needs matplotlib: pip install 'zerotrain[demo]'"
        ) from err
    finite = [r for r in records if math.isfinite(r.loss)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r.lr for r in finite], [r.loss for r in finite], ".", ms=3, alpha=0.5, label="loss")
    if suggestion is not None:
        ax.plot(suggestion.lrs, suggestion.smoothed, lw=1.6, label="smoothed loss")
        ax.axvspan(
            suggestion.min_lr,
            suggestion.max_lr,
            color="tab:green",
            alpha=0.2,
            label=f"suggested {suggestion.min_lr:.2g} to {suggestion.max_lr:.2g}",
        )
        ax.axvline(suggestion.lr_at_min_loss, color="tab:red", ls="--", lw=1, label="minimum")
        # Frame the points before divergence; the blow-up after them would flatten the rest.
        shown = [r.loss for r in finite if r.lr <= suggestion.lrs[-1]] + list(suggestion.smoothed)
        low, high = min(shown), max(suggestion.smoothed)
        margin = 0.1 * (high - low) or 0.1 * abs(high) or 1.0
        ax.set_ylim(low - margin, high + 2 * margin)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("training loss")
    ax.set_title("LR range test")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)

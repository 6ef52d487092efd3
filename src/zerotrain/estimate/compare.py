"""Predicted versus measured memory, as the engine reports it after its first step."""

from __future__ import annotations

from zerotrain.engine.accounting import MemoryBreakdown
from zerotrain.estimate.core import CATEGORIES, MemoryEstimate
from zerotrain.utils.memory import format_bytes

# What engine.memory_breakdown() measures: every predicted category but activations.
_MEASURED = tuple(c for c in CATEGORIES if c != "activations")


def _line(name: str, predicted: int, measured: int) -> str:
    if measured:
        error = f"{100.0 * (predicted - measured) / measured:+.1f}%"
    else:
        error = "exact" if predicted == 0 else "n/a"
    return (
        f"{name:<18} predicted {format_bytes(predicted):>10}  "
        f"measured {format_bytes(measured):>10}  ({error})"
    )


def compare(
    estimate: MemoryEstimate, breakdown: MemoryBreakdown, peak_rss_bytes: int | None = None
) -> str:
    """Lines of "predicted vs measured" per category, for the model states the engine
    accounts (``engine.memory_breakdown()``), their total, and the peak resident memory.

    Predicted categories count the bytes the estimate keeps in memory (device and host);
    what it places on NVMe is compared with the swap files' size on a line of its own.

    Args:
        estimate: the prediction for this rank (``estimate_memory(..., rank=rank)``).
        breakdown: this rank's measured model states.
        peak_rss_bytes: the process's peak resident memory, if known; compared with the
            estimate's host prediction (baseline, activations and states on a CPU rank).

    Returns:
        One line per category, then totals; no trailing newline.
    """
    measured = breakdown.as_dict()
    lines = ["memory: predicted vs measured (this rank)"]
    predicted_total = 0
    for name in _MEASURED:
        placed = estimate.category(name)
        predicted = placed.device + placed.cpu
        predicted_total += predicted
        lines.append(_line(name, predicted, measured[name]))
    lines.append(_line("model states total", predicted_total, breakdown.total))
    if estimate.nvme_total or breakdown.nvme:
        lines.append(_line("nvme (swap files)", estimate.nvme_total, breakdown.nvme))
    if peak_rss_bytes is not None:
        host = estimate.host_bytes
        if estimate.device_type == "cuda":
            host += estimate.activations.cpu
        lines.append(_line("peak RSS", host, peak_rss_bytes))
        if not estimate.baseline_bytes:
            lines.append("  (RSS prediction has no baseline: interpreter and torch not included)")
    return "\n".join(lines)

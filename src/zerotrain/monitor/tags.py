"""Tag names of the series the engine logs, shared by the engine, the tests and the docs.

The names follow DeepSpeed's (``Train/Samples/train_loss``, ...) so dashboards and scripts
written for DeepSpeed runs read ours unchanged. Under ``Train/Samples/`` the step of every
event is the number of samples seen so far (the engine's ``global_samples``), as in
DeepSpeed, so runs with different batch sizes line up on one axis.
"""

from __future__ import annotations

TRAIN_LOSS = "Train/Samples/train_loss"
"""Loss of the last optimizer step (mean over the accumulated micro-batches)."""

LEARNING_RATE = "Train/Samples/lr"
"""Learning rate of the first parameter group after the scheduler step."""

LOSS_SCALE = "Train/Samples/loss_scale"
"""Current fp16 loss scale (only logged when fp16 is enabled)."""

GRAD_NORM = "Train/Samples/grad_norm"
"""Global L2 norm of the gradients before clipping."""

SAMPLES_PER_SEC = "Train/Samples/samples_per_sec"
"""Training throughput over the last logging interval, all ranks together."""

MEMORY_PREFIX = "Train/Memory/"
"""Prefix of the per-rank memory series; build the full tag with :func:`memory_tag`."""

PEAK_RSS_MIB = "peak_rss_MiB"
"""Memory metric: peak resident set size of the rank's process, in MiB."""

DEVICE_PEAK_ALLOCATED_MIB = "device_peak_allocated_MiB"
"""Memory metric: peak accelerator memory allocated by the rank's process, in MiB."""


def memory_tag(rank: int, metric: str = PEAK_RSS_MIB) -> str:
    """Tag of one rank's memory series, e.g. ``memory_tag(1)`` is
    ``"Train/Memory/rank1_peak_rss_MiB"``.

    Only rank 0 writes, so the engine collects every rank's figure first and logs one
    series per rank; a separate series per rank keeps an imbalance visible.

    Args:
        rank: the rank the figure belongs to (not the rank that writes it).
        metric: what was measured, e.g. :data:`PEAK_RSS_MIB`.

    Raises:
        ValueError: ``rank`` is negative or ``metric`` is empty or contains ``/``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"memory_tag: rank must be an int >= 0, got {rank!r}")
    if not metric or "/" in metric:
        raise ValueError(f"memory_tag: metric must be a non-empty name without '/', got {metric!r}")
    return f"{MEMORY_PREFIX}rank{rank}_{metric}"

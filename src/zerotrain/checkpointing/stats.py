"""What checkpointed regions did: the counters of one checkpointing context."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointStats:
    """What checkpointed regions did since the last ``reset_stats``.

    ``calls`` and ``kept_bytes`` (the inputs the regions kept for their recomputation;
    ``offloaded_bytes`` of them in host memory; ``partitioned_bytes`` not kept on this rank
    because the tensor group holds them) are always counted; the times only with
    ``profile`` on, because timing an accelerator needs a synchronization.
    """

    calls: int = 0
    recomputes: int = 0
    kept_bytes: int = 0
    offloaded_bytes: int = 0
    partitioned_bytes: int = 0
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0

    def summary(self) -> str:
        """One line for the training log."""
        mib = 1 << 20
        return (
            f"activation checkpointing: {self.calls} forward(s) {self.forward_seconds:.3f} s, "
            f"{self.recomputes} recomputation(s) {self.recompute_seconds:.3f} s, "
            f"inputs kept {self.kept_bytes / mib:.1f} MiB "
            f"({self.offloaded_bytes / mib:.1f} MiB in host memory, "
            f"{self.partitioned_bytes / mib:.1f} MiB left to the tensor group)"
        )

"""The active activation-checkpointing settings and the counters they feed.

``checkpoint(fn, *args)`` takes no options (the call sites live inside model code), so the
settings are process-wide: ``initialize`` sets them from the config's
``activation_checkpointing`` section and ``configure`` changes them by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zerotrain.config.policies import ActivationCheckpointingPolicy

# configure()'s keyword arguments are the config keys; these are their policy fields.
_FIELD_OF_KEY = {
    "partition_activations": "partition_activations",
    "cpu_checkpointing": "cpu_checkpointing",
    "contiguous_memory_optimization": "contiguous_memory",
    "number_checkpoints": "number_checkpoints",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


@dataclass
class CheckpointStats:
    """What checkpointed regions did since the last ``reset_stats``.

    ``calls`` and ``kept_bytes`` (the inputs the regions kept for their recomputation;
    ``offloaded_bytes`` of them in host memory) are always counted; the times only with
    ``profile`` on, because timing an accelerator needs a synchronization.
    """

    calls: int = 0
    recomputes: int = 0
    kept_bytes: int = 0
    offloaded_bytes: int = 0
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0

    def summary(self) -> str:
        """One line for the training log."""
        mib = 1 << 20
        return (
            f"activation checkpointing: {self.calls} forward(s) {self.forward_seconds:.3f} s, "
            f"{self.recomputes} recomputation(s) {self.recompute_seconds:.3f} s, "
            f"inputs kept {self.kept_bytes / mib:.1f} MiB "
            f"({self.offloaded_bytes / mib:.1f} MiB in host memory)"
        )


class _State:
    def __init__(self) -> None:
        self.policy = ActivationCheckpointingPolicy()
        self.stats = CheckpointStats()
        self.generation = 0  # bumped by configure: buffers built for older settings go


STATE = _State()


def configure(
    policy: ActivationCheckpointingPolicy | None = None, **keys: bool | int | None
) -> ActivationCheckpointingPolicy:
    """Set how ``checkpoint`` behaves from now on, in this process.

    Args:
        policy: settings to start from (default: the current ones).
        **keys: ``activation_checkpointing`` config keys to change: ``partition_activations``,
            ``cpu_checkpointing``, ``contiguous_memory_optimization``, ``number_checkpoints``,
            ``synchronize_checkpoint_boundary``, ``profile``.

    Returns:
        The settings now in force.

    Raises:
        TypeError: a key that is not one of those.
    """
    unknown = sorted(set(keys) - set(_FIELD_OF_KEY))
    if unknown:
        raise TypeError(
            f"configure() got unknown option(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(_FIELD_OF_KEY)}"
        )
    base = policy if policy is not None else STATE.policy
    changes: dict[str, Any] = {_FIELD_OF_KEY[k]: v for k, v in keys.items()}
    STATE.policy = dataclasses.replace(base, **changes)
    STATE.generation += 1
    return STATE.policy


def reset() -> None:
    """Back to the defaults (checkpoint inputs kept as they are, nothing timed)."""
    STATE.policy = ActivationCheckpointingPolicy()
    STATE.generation += 1
    reset_stats()


def current() -> ActivationCheckpointingPolicy:
    """The settings in force."""
    return STATE.policy


def stats() -> CheckpointStats:
    """A copy of the counters since the last ``reset_stats``."""
    return dataclasses.replace(STATE.stats)


def reset_stats() -> None:
    """Start counting afresh."""
    STATE.stats = CheckpointStats()

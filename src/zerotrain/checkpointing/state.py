"""Activation-checkpointing settings and the counters they feed, per engine.

``checkpoint(fn, *args)`` takes no options (the call sites live inside model code), so it
reads the *active* ``CheckpointingContext``: the engine's own while the engine runs its
forward and backward (``initialize`` builds it from the config's
``activation_checkpointing`` section), else the process's default, which ``configure``
changes by hand and which an engine whose config has no such section shares. Two engines
in one process (a GAN's generator and discriminator; the stages of a pipeline) thus keep
their own settings, input buffers and counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from zerotrain.checkpointing.saved_inputs import InputKeeper
from zerotrain.checkpointing.stats import CheckpointStats
from zerotrain.comm.collectives import Communicator
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


class CheckpointingContext:
    """One set of settings, with the input buffers and counters that go with them.

    Args:
        policy: the settings (default: inputs kept as they are, nothing timed).
        partition_group: the tensor group ``partition_activations`` splits inputs over.
    """

    def __init__(
        self,
        policy: ActivationCheckpointingPolicy | None = None,
        partition_group: Communicator | None = None,
    ) -> None:
        self.policy = policy or ActivationCheckpointingPolicy()
        # The tensor group that partition_activations splits inputs over (None: none).
        self.partition_group = partition_group
        self.stats = CheckpointStats()
        self.depth = 0  # checkpointed regions whose forward is running now
        self._keeper: InputKeeper | None = None  # built for the current policy

    def set_policy(self, policy: ActivationCheckpointingPolicy) -> None:
        """Use ``policy`` from now on (buffers built for the old settings are dropped)."""
        self.policy = policy
        self._keeper = None

    def keeper(self) -> InputKeeper:
        """Where the inputs of this context's regions are kept."""
        if self._keeper is None:
            policy = self.policy
            self._keeper = InputKeeper(
                policy.cpu_checkpointing,
                policy.contiguous_memory,
                policy.number_checkpoints,
                self.stats,
                self.partition_group if policy.partition_activations else None,
            )
        self._keeper.stats = self.stats  # reset_stats() replaces the counters
        return self._keeper

    def reset_stats(self) -> None:
        """Start counting afresh."""
        self.stats = CheckpointStats()

    @contextlib.contextmanager
    def active(self) -> Iterator[CheckpointingContext]:
        """Make this the context ``checkpoint`` uses, for the duration."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


# The process's default context (used outside any engine, and by engines whose config has no
# activation_checkpointing section), and the one active now.
_DEFAULT = CheckpointingContext()
_ACTIVE: ContextVar[CheckpointingContext | None] = ContextVar(
    "zerotrain_checkpointing", default=None
)


def active_context() -> CheckpointingContext:
    """The context ``checkpoint`` uses now: the running engine's, else the default."""
    return _ACTIVE.get() or _DEFAULT


def default_context() -> CheckpointingContext:
    """The process's default context (what ``configure`` changes)."""
    return _DEFAULT


def configure(
    policy: ActivationCheckpointingPolicy | None = None, **keys: bool | int | None
) -> ActivationCheckpointingPolicy:
    """Set how ``checkpoint`` behaves from now on, outside engines (and in engines whose
    config has no ``activation_checkpointing`` section).

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
    base = policy if policy is not None else _DEFAULT.policy
    changes: dict[str, Any] = {_FIELD_OF_KEY[k]: v for k, v in keys.items()}
    _DEFAULT.set_policy(dataclasses.replace(base, **changes))
    return _DEFAULT.policy


def reset() -> None:
    """Back to the defaults (checkpoint inputs kept as they are, nothing timed)."""
    _DEFAULT.set_policy(ActivationCheckpointingPolicy())
    reset_stats()


def current() -> ActivationCheckpointingPolicy:
    """The settings in force now (the running engine's, else the default)."""
    return active_context().policy


def stats() -> CheckpointStats:
    """A copy of the active context's counters since its last ``reset_stats``."""
    return dataclasses.replace(active_context().stats)


def reset_stats() -> None:
    """Start counting afresh (the active context)."""
    active_context().reset_stats()

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
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from zerotrain.checkpointing.deepspeed_args import partition_group_of, policy_from_config
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
# DeepSpeed's configure() argument names -> the config keys above.
_KEY_OF_ARGUMENT = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}
# configure()'s mpu_ when not passed (None is a value: DeepSpeed's spelling, no group).
_UNSET: Any = object()


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
        # Whether the settings were chosen (an engine's section, or configure()), for
        # DeepSpeed's is_configured().
        self.configured = policy is not None
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
    mpu_: Any = _UNSET,
    deepspeed_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    policy: ActivationCheckpointingPolicy | None = None,
    **keys: bool | int | None,
) -> ActivationCheckpointingPolicy:
    """Set how ``checkpoint`` behaves from now on, outside engines (and in engines whose
    config has no ``activation_checkpointing`` section).

    Two spellings. DeepSpeed's, ``configure(mpu_, deepspeed_config=None,
    partition_activations=None, ...)``: starts from the defaults, applies the
    ``activation_checkpointing`` section of ``deepspeed_config``, then every argument that is
    not None. zerotrain's, ``configure(**keys)`` with config key names: changes only those
    keys of the current settings (of ``policy`` if given).

    Args:
        mpu_: None, or Megatron's model-parallel unit: ``partition_activations`` splits
            kept inputs over its ``get_tensor_model_parallel_group()`` (else
            ``get_model_parallel_group()``), a torch process group or a zerotrain
            ``Communicator``. Passing it, even None, selects DeepSpeed's spelling.
        deepspeed_config: a config dict or JSON path; its ``activation_checkpointing``
            section is applied (absent: the defaults).
        partition_activations, contiguous_checkpointing, num_checkpoints,
            checkpoint_in_cpu, synchronize, profile: DeepSpeed's names for the keys
            below; None leaves the value from the defaults / ``deepspeed_config``.
        policy: settings to start from (zerotrain's spelling; default: the current ones).
        **keys: ``activation_checkpointing`` config keys to change: ``partition_activations``,
            ``cpu_checkpointing``, ``contiguous_memory_optimization``, ``number_checkpoints``,
            ``synchronize_checkpoint_boundary``, ``profile``.

    Returns:
        The settings now in force.

    Raises:
        TypeError: a key that is not one of those, or an ``mpu_`` without a group getter.
        ConfigError: ``deepspeed_config`` is not a valid config.
    """
    if isinstance(mpu_, ActivationCheckpointingPolicy):
        policy, mpu_ = mpu_, _UNSET  # the earlier positional configure(policy)
    unknown = sorted(set(keys) - set(_FIELD_OF_KEY))
    if unknown:
        raise TypeError(
            f"configure() got unknown option(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(_FIELD_OF_KEY)} (or DeepSpeed's: {', '.join(_KEY_OF_ARGUMENT)})"
        )
    arguments = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    deepspeed_style = mpu_ is not _UNSET or deepspeed_config is not None
    changes: dict[str, Any] = {_FIELD_OF_KEY[k]: v for k, v in keys.items()}
    for name, value in arguments.items():
        if value is not None:
            changes[_FIELD_OF_KEY[_KEY_OF_ARGUMENT[name]]] = value
            deepspeed_style |= name not in _FIELD_OF_KEY
    if policy is not None:
        base = policy
    elif deepspeed_style:
        # DeepSpeed's configure() starts again from the defaults every time.
        base = ActivationCheckpointingPolicy()
        if deepspeed_config is not None:
            base = policy_from_config(deepspeed_config)
    else:
        base = _DEFAULT.policy
    if mpu_ is not _UNSET and mpu_ is not None:
        _DEFAULT.partition_group = partition_group_of(mpu_)
    _DEFAULT.set_policy(dataclasses.replace(base, **changes))
    _DEFAULT.configured = True
    return _DEFAULT.policy


def is_configured() -> bool:
    """Whether the settings ``checkpoint`` uses now were set: by ``configure`` (outside
    engines), or by the running engine's ``activation_checkpointing`` section. DeepSpeed's
    name; Megatron scripts test it before choosing which ``checkpoint`` to call."""
    return active_context().configured


def reset() -> None:
    """Back to the defaults (checkpoint inputs kept as they are, nothing timed, no
    partition group, not configured)."""
    _DEFAULT.set_policy(ActivationCheckpointingPolicy())
    _DEFAULT.partition_group = None
    _DEFAULT.configured = False
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

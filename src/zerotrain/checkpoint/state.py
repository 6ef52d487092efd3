"""What saving and loading need from a training job, as protocols: the checkpoint layer never
reads an engine's attributes, so an engine, a pipeline stage's runner or a test can each
provide these.

- :class:`Placement`: where this process sits (global rank, the grid, the communicators).
- :class:`ShardedStateView`: what the ZeRO strategy holds (its units and the calls around
  reading and writing them); ``ZeroStrategy`` satisfies it as it is.
- :class:`TrainState`: counters, optimizer, scheduler, loss scaler, data loader, module.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.topology import Topology
from zerotrain.shard.unit import ShardedUnit


class Stateful(Protocol):
    """Something with ``state_dict`` / ``load_state_dict`` (scheduler, scaler, data loader)."""

    def state_dict(self) -> dict[str, Any]:
        """The state to save (JSON-able: numbers, strings, lists and dicts of them)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        ...


@dataclass(frozen=True, slots=True)
class Counters:
    """The training-progress counters a checkpoint restores."""

    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job.

    Attributes:
        global_rank: this process's rank in the whole job; it names the shard file.
        topology: the grid the job runs on (recorded in the manifest).
        world: a communicator over every rank of the job (agreement, manifest merge).
        data: the communicator ZeRO shards over (this rank's data-parallel group).
        device: where this rank computes (random states of its device are saved).
    """

    global_rank: int
    topology: Topology
    world: Communicator
    data: Communicator
    device: torch.device


class ShardedStateView(Protocol):
    """What the ZeRO strategy holds, in the terms a checkpoint needs."""

    @property
    def units(self) -> Sequence[ShardedUnit]:
        """Every unit (flat buffer of parameters, with its owned range and master slice)."""
        ...

    def managed(self) -> set[int]:
        """``id()`` of every parameter inside a unit."""
        ...

    def resident(self, write_back: bool) -> AbstractContextManager[None]:
        """Offloaded states in memory for the duration (written back if ``write_back``)."""
        ...

    def adopt_outside_changes(self) -> None:
        """Take in parameter values the user wrote since the last step."""
        ...

    def zero_grads(self) -> None:
        """Drop accumulated gradients."""
        ...

    def refresh_params(self) -> None:
        """All-gather the units' owned slices so every rank holds whole parameters again."""
        ...


class TrainState(Protocol):
    """A training job as a checkpoint sees it (``zerotrain.Engine.checkpoint_state()``)."""

    @property
    def placement(self) -> Placement:
        """Ranks, grid and communicators."""
        ...

    @property
    def sharded(self) -> ShardedStateView:
        """The ZeRO strategy's units."""
        ...

    @property
    def module(self) -> nn.Module:
        """The user's model (names and buffers; its parameters live in the units)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose states are saved."""
        ...

    @property
    def steps_model_params(self) -> bool:
        """Whether the optimizer steps the model's own parameters (a user optimizer at
        stage 0) rather than the units' flat pieces."""
        ...

    @property
    def lr_scheduler(self) -> Stateful | None:
        """The learning-rate schedule."""
        ...

    @property
    def loss_scaler(self) -> Stateful | None:
        """The fp16 loss scaler."""
        ...

    @property
    def data_loader(self) -> Stateful | None:
        """The data loader whose position is saved."""
        ...

    @property
    def stage(self) -> int:
        """The ZeRO stage."""
        ...

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The mixed-precision compute dtype (None: fp32)."""
        ...

    @property
    def tag_validation(self) -> str:
        """``checkpoint.tag_validation``: what to do when ranks pass different tags."""
        ...

    @property
    def keep_last(self) -> int | None:
        """``checkpoint.keep_last``: complete checkpoints kept in a save directory."""
        ...

    def original_dtype(self, tensor: torch.Tensor) -> torch.dtype | None:
        """The dtype ``tensor`` (outside the units) had before mixed precision cast it."""
        ...

    def counters(self) -> Counters:
        """The progress counters now."""
        ...

    def check_can_load(self) -> None:
        """Raise if loading now would be wrong (between backward and step)."""
        ...

    def restore_counters(self, saved: Counters) -> None:
        """Resume from ``saved`` (a new accumulation window starts)."""
        ...

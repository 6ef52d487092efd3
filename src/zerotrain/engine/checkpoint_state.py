"""The engine as ``checkpoint.state.TrainState``: the one place that hands the engine's
private state (how its optimizer is bound, the dtypes mixed precision cast away, whether a
backward awaits its step) to the checkpoint layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerotrain.checkpoint.state import Counters, Placement, ShardedStateView, Stateful

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine


class EngineCheckpointState:
    """:class:`zerotrain.checkpoint.state.TrainState` over an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._original = {id(t): dtype for t, dtype in engine._cast_back}

    @property
    def placement(self) -> Placement:
        """Ranks, grid and communicators of the engine."""
        e = self._engine
        return Placement(e.global_rank, e.topology, e.groups.world, e.groups.zero, e.device)

    @property
    def sharded(self) -> ShardedStateView:
        """The engine's ZeRO strategy."""
        return self._engine.strategy

    @property
    def module(self) -> nn.Module:
        """The wrapped model."""
        return self._engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The engine's optimizer."""
        return self._engine.optimizer

    @property
    def steps_model_params(self) -> bool:
        """Whether the optimizer steps the model's parameters, not unit pieces."""
        return self._engine._steps_model_params

    @property
    def lr_scheduler(self) -> Stateful | None:
        """The scheduler, if it has a state dict."""
        scheduler: Any = self._engine.lr_scheduler
        return scheduler if hasattr(scheduler, "state_dict") else None

    @property
    def loss_scaler(self) -> Stateful | None:
        """The fp16 loss scaler."""
        return self._engine.loss_scaler

    @property
    def data_loader(self) -> Stateful | None:
        """The loader ``initialize`` built from ``training_data``."""
        return self._engine.training_dataloader

    @property
    def stage(self) -> int:
        """The ZeRO stage."""
        return self._engine.policy.stage

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The mixed-precision compute dtype."""
        return self._engine.precision.compute

    @property
    def tag_validation(self) -> str:
        """``checkpoint.tag_validation``."""
        return self._engine.policy.tag_validation

    @property
    def keep_last(self) -> int | None:
        """``checkpoint.keep_last``."""
        return self._engine.policy.keep_last

    def original_dtype(self, tensor: torch.Tensor) -> torch.dtype | None:
        """The dtype before mixed precision cast a tensor outside the units."""
        return self._original.get(id(tensor))

    def counters(self) -> Counters:
        """The engine's step and sample counters."""
        e = self._engine
        return Counters(e.global_steps, e.global_samples, e.micro_steps, e.skipped_steps)

    def check_can_load(self) -> None:
        """Loading between backward and step would leave the step half-applied."""
        if self._engine._backward_pending_step:
            raise RuntimeError("load_checkpoint() between backward() and step(): call step() first")

    def restore_counters(self, saved: Counters) -> None:
        """Counters from a checkpoint; the next micro-step starts an accumulation window
        (a partial window's gradients are not saved), also when the accumulation steps
        differ from the saving run's."""
        e = self._engine
        e.global_steps = saved.global_steps
        e.global_samples = saved.global_samples
        e.micro_steps = saved.global_steps * e.gradient_accumulation_steps()
        e.skipped_steps = saved.skipped_steps

"""The Engine: the training-step state machine behind ``zerotrain.initialize``.

One micro-step is ``engine(batch)`` -> ``engine.backward(loss)`` -> ``engine.step()``.
Gradients accumulate in flat buffers over ``gradient_accumulation_steps`` micro-steps; only
the last (the accumulation boundary) communicates, reducing gradients from autograd hooks
while backward is still running. ``step()`` then clips, updates and schedules, and does
nothing but count on the other micro-steps. The Engine is a thin facade: units, hooks,
collectives and optimizer math live in their own layers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.env import DistEnv
from zerotrain.comm.stats import CommSnapshot
from zerotrain.config.policies import TrainingPolicy
from zerotrain.engine.accounting import (
    MemoryBreakdown,
    buffer_bytes,
    optimizer_state_bytes,
    tensor_bytes,
)
from zerotrain.optim.clip import clip_grads_
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import format_bytes, peak_rss_bytes
from zerotrain.zero.grad_sync import GradientSynchronizer

log = get_logger(__name__)


class Engine:
    """Wraps a model for data-parallel training; built by :func:`zerotrain.initialize`.

    Attributes:
        module: the user's model (its parameters now live in flat buffers).
        optimizer: the optimizer stepped at each accumulation boundary.
        lr_scheduler: stepped after each optimizer step (or None).
        env: rank, world size, device and backend of this process.
    """

    def __init__(
        self,
        module: nn.Module,
        env: DistEnv,
        comm: Communicator,
        policy: TrainingPolicy,
        units: Sequence[ShardedUnit],
        sync: GradientSynchronizer,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
    ) -> None:
        self.module = module
        self.env = env
        self.comm = comm
        self.policy = policy
        self.units = list(units)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._sync = sync
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._backward_pending_step = False
        self._grad_norm: torch.Tensor | None = None
        self._window_losses: list[torch.Tensor] = []
        self._window_start = time.perf_counter()
        self._window_samples = 0

    # -- forward / backward / step ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (same signature as the model)."""
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-step whose ``step()`` updates the parameters."""
        return (self.micro_steps + 1) % self.policy.batch.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate ``loss`` of one micro-batch.

        The loss is divided by the number of accumulation steps, so the accumulated gradient
        is the mean over the global batch. On the boundary micro-step, gradients are
        averaged across ranks while backward runs; this call returns once they are.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("backward() needs the scalar loss tensor of this micro-batch")
        if not loss.requires_grad:
            raise RuntimeError(
                "the loss does not require grad: was the forward run under torch.no_grad() "
                "or with every parameter frozen?"
            )
        if self._backward_pending_step:
            raise RuntimeError(
                "backward() called twice without step(): call engine.step() after every "
                "engine.backward(), or sum the losses of one micro-batch first"
            )
        gas = self.policy.batch.gradient_accumulation_steps
        self._sync.begin_backward(sync=self.is_gradient_accumulation_boundary())
        try:
            (loss / gas if gas > 1 else loss).backward(retain_graph=retain_graph)
        finally:
            self._sync.end_backward()
        self._window_losses.append(loss.detach())
        self._backward_pending_step = True

    def step(self) -> None:
        """Finish the micro-step; on the accumulation boundary clip, update and schedule."""
        if not self._backward_pending_step:
            raise RuntimeError(
                "step() called without engine.backward(loss) for this micro-step (calling "
                "loss.backward() directly bypasses gradient averaging)"
            )
        batch = self.policy.batch
        if self.is_gradient_accumulation_boundary():
            grads = [unit.optimizer_grad() for unit in self.units]
            # Kept as a tensor: converting it here would force a device sync every step.
            self._grad_norm = clip_grads_(grads, self.policy.clip_norm)
            if self.optimizer is not None:
                self.optimizer.step()
            for unit in self.units:
                unit.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            if self.global_steps % self.policy.steps_per_print == 0:
                self._report()
        self.micro_steps += 1
        self.global_samples += batch.micro_batch_size * batch.dp_world_size
        self._window_samples += batch.micro_batch_size * batch.dp_world_size
        self._backward_pending_step = False

    def zero_grad(self) -> None:
        """Zero accumulated gradients (the engine already does this after each step)."""
        for unit in self.units:
            unit.buffer.zero_grads()

    # -- modes and queries ------------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        """Put the model in training mode (like ``nn.Module.train``)."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """Put the model in evaluation mode."""
        return self.train(False)

    def get_lr(self) -> list[float]:
        """Learning rate of each optimizer param group."""
        if self.optimizer is None:
            return []
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm (before clipping) at the last optimizer step."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def train_batch_size(self) -> int:
        """Samples per optimizer step across all ranks."""
        return self.policy.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-step on one rank."""
        return self.policy.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.policy.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage in use."""
        return self.policy.stage

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self.env.device

    def comm_stats(self) -> CommSnapshot:
        """Collectives issued since start-up (or the last reset), by op and purpose."""
        return self.comm.snapshot()

    def reset_comm_stats(self) -> None:
        """Restart the collective counters."""
        self.comm.stats.reset()

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds for model states, by category."""
        in_units = {id(p) for unit in self.units for p in unit.buffer.params}
        loose = [p for p in self.module.parameters() if id(p) not in in_units]
        return MemoryBreakdown(
            params=sum(unit.buffer.nbytes for unit in self.units) + tensor_bytes(loose),
            grads=sum(unit.buffer.grad_nbytes for unit in self.units),
            master_weights=0,
            optimizer_states=optimizer_state_bytes(self.optimizer),
            buffers=buffer_bytes(self.module),
        )

    # -- not yet available --------------------------------------------------------------------

    def save_checkpoint(
        self, save_dir: str, tag: str | None = None, client_state: Any = None
    ) -> None:
        """Sharded checkpoints are not implemented in this version."""
        raise NotImplementedError("zerotrain checkpoints are not implemented yet")

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        """Sharded checkpoints are not implemented in this version."""
        raise NotImplementedError("zerotrain checkpoints are not implemented yet")

    def destroy(self) -> None:
        """Remove the engine's autograd hooks from the model."""
        self._sync.remove()

    # -- logging ------------------------------------------------------------------------------

    def _report(self) -> None:
        # Average the window's loss over ranks: one tiny collective every steps_per_print.
        local = (
            torch.stack(self._window_losses).float().mean().item() if self._window_losses else 0.0
        )
        mean_loss = self.comm.all_reduce_floats([local])[0] / self.comm.world_size
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
        message = (
            f"step {self.global_steps}: loss {mean_loss:.4f}, lr [{lrs}], "
            f"grad norm {self.get_global_grad_norm() or 0.0:.4f}, "
            f"{self._window_samples / elapsed:.1f} samples/s"
        )
        if self.policy.log_memory:
            message += f", peak RSS {format_bytes(peak_rss_bytes())}; {self.memory_breakdown()}"
        log.info(message)
        self._window_losses.clear()
        self._window_samples = 0
        self._window_start = time.perf_counter()

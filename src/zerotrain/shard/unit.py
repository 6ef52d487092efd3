"""A unit: parameters gathered, reduced and stepped together, over one flat buffer.

The unit owns the mechanics (which collective, which slice, scaling); *when* its methods run is
decided by ``zero/grad_sync.py`` and the engine. Gradient states move through a checked cycle
ACCUMULATING -> REDUCING -> REDUCED -> ACCUMULATING, so an ordering bug raises immediately
instead of silently stepping on half-reduced gradients.
"""

from __future__ import annotations

import enum

import torch

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.config.policies import GradReducePolicy
from zerotrain.shard.flat_buffer import FlatParamBuffer
from zerotrain.utils.invariant import invariant
from zerotrain.zero.policy import ZeroPolicy


class GradState(enum.Enum):
    """Where a unit's gradient is in the step."""

    ACCUMULATING = "accumulating"  # autograd adds micro-step gradients into the buffer
    REDUCING = "reducing"  # a collective on the buffer is in flight
    REDUCED = "reduced"  # the buffer holds the average over ranks; ready for the optimizer


class ShardedUnit:
    """One flat buffer of parameters and its gradient, plus how it is reduced.

    Args:
        index: position of the unit in the model (stable across ranks).
        buffer: the packed parameters.
        group_index: optimizer parameter group of every parameter here (None: not optimized).
        comm: collectives over the data-parallel group.
        zero: which states are partitioned.
        reduce: how gradients are averaged.
    """

    def __init__(
        self,
        index: int,
        buffer: FlatParamBuffer,
        group_index: int | None,
        comm: Communicator,
        zero: ZeroPolicy,
        reduce: GradReducePolicy,
    ) -> None:
        invariant(
            not zero.shard_optimizer and buffer.layout.world_size == 1,
            "this unit implements ZeRO stage 0 (replicated states) only",
        )
        self.index = index
        self.buffer = buffer
        self.group_index = group_index
        self.comm = comm
        self.zero = zero
        self.reduce = reduce
        self.state = GradState.ACCUMULATING
        buffer.allocate_grads()

    def __repr__(self) -> str:
        names = ", ".join(s.fqn for s in self.buffer.layout.params[:3])
        more = "" if len(self.buffer.params) <= 3 else f", +{len(self.buffer.params) - 3}"
        return f"ShardedUnit({self.index}: {names}{more}; {self.state.value})"

    @property
    def numel(self) -> int:
        """Elements of real parameters in this unit."""
        return self.buffer.layout.numel

    def optimizer_param(self) -> torch.Tensor:
        """The flat tensor the optimizer updates for this rank (all of it at stage 0)."""
        return self.buffer.data

    def optimizer_grad(self) -> torch.Tensor:
        """The flat gradient matching :meth:`optimizer_param`."""
        invariant(self.buffer.grad is not None, "gradients not allocated")
        return self.buffer.grad  # type: ignore[return-value]

    def launch_reduce(self, *, async_op: bool = True) -> Handle:
        """Start averaging this unit's gradient over the data-parallel ranks."""
        invariant(
            self.state is GradState.ACCUMULATING,
            f"{self!r}: reduce launched twice in one step",
        )
        grad = self.optimizer_grad()
        if self.reduce.pre_divide != 1.0:
            grad.div_(self.reduce.pre_divide)
        self.state = GradState.REDUCING

        def on_done() -> None:
            if self.reduce.post_divide != 1.0:
                grad.div_(self.reduce.post_divide)
            self.state = GradState.REDUCED

        return self.comm.all_reduce(grad, purpose="gradients", async_op=async_op, on_done=on_done)

    def after_step(self) -> None:
        """Called once the optimizer consumed the gradient: start the next accumulation."""
        invariant(
            self.state is GradState.REDUCED,
            f"{self!r}: optimizer step before its gradient was reduced",
        )
        self.buffer.zero_grads()
        self.state = GradState.ACCUMULATING

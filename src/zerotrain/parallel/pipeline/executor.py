"""Running one rank's instruction list: forwards, backwards and the messages between stages.

The schedule (``builders.py``) says what this rank does and in which order; the plan
(``plan.py``) says when, among those actions, each message is posted, so that every pair of
ranks posts the messages it exchanges in mirrored orders, the order NCCL matches by. The
executor walks the plan: compute actions call the stage module (``F``) and autograd
(``B``); each exchange is posted through the pipe communicator's ordered entry point
(``boundary.py``); a receive is waited for by the action that consumes it, a send is held
until it completed. ``nccl_rules.py`` replays what this posts and waits for under NCCL's
rules for every schedule the builders make.

What crosses the boundaries, and how shapes are agreed without a message per micro-batch,
is ``boundary.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerotrain.comm import liveness
from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.pipeline import messages
from zerotrain.parallel.pipeline.boundary import Received, StageBoundaries
from zerotrain.parallel.pipeline.messages import Channel
from zerotrain.parallel.pipeline.plan import Exchange, Message, build_plan
from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.utils.invariant import InvariantError


class StageModule(Protocol):
    """What the executor needs of a stage module (``PipelineModule`` is one)."""

    loss_fn: Callable[..., Any] | None

    def __call__(self, x: Any, chunk: int = 0) -> Any:
        """Run the rank's local chunk ``chunk`` on ``x``."""
        ...

    def chunk_layers(self, chunk: int) -> range:
        """Global layer indices of (global) chunk ``chunk``."""
        ...

    def describe_layer(self, idx: int) -> str:
        """How messages name global layer ``idx``."""
        ...


class StageBackward(Protocol):
    """Runs autograd for one backward action (the engine's side: loss scaling, ZeRO's
    gradient-sync knobs). ``grads`` is None for the last stage, whose ``roots`` is the
    micro-batch's loss."""

    def __call__(
        self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, action: Action
    ) -> None: ...


@dataclass
class _Step:
    """What one step keeps between its actions."""

    signatures: Sequence[int]
    inputs: Sequence[Any] | None
    labels: Sequence[Any] | None
    train: bool
    received: dict[Message, Received] = field(default_factory=dict)
    # Per (stage, micro-batch): the stage's inputs (leaves) and outputs, until its backward.
    stage_inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    stage_outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


class PipelineExecutor:
    """Runs this rank's actions of ``schedule`` over ``comm`` (the pipe communicator).

    Args:
        module: this rank's stage module; ``module(x, chunk=k)`` runs its k-th local chunk
            (virtual stage ``rank + k * P``) and ``module.chunk_layers(stage)`` names the
            global layer indices of a stage (for error messages).
        comm: the ranks of this pipeline, in stage order.
        schedule: the instruction lists, with communication actions.
    """

    def __init__(
        self,
        module: StageModule,
        comm: Communicator,
        schedule: PipelineSchedule,
    ) -> None:
        if schedule.num_ranks != comm.world_size:
            raise ValueError(
                f"the schedule has {schedule.num_ranks} ranks, the pipeline {comm.world_size}"
            )
        self.module = module
        self.comm = comm
        self.schedule = schedule
        self.loss_fn = module.loss_fn
        self.rank = comm.rank
        self.last_stage = schedule.num_stages - 1
        # (action, start, end) of each compute action of the last step, in time.monotonic()
        # seconds (one clock for every process of a machine), when ``record_timeline``;
        # from when its inputs (or gradients) had arrived to when it was done.
        self.record_timeline = False
        self.timeline: list[tuple[Action, float, float]] = []
        self.boundaries = StageBoundaries(comm, self._layer_name)

    # -- the step ---------------------------------------------------------------------------

    def run(
        self,
        inputs: Sequence[Any] | None,
        labels: Sequence[Any] | None,
        signatures: Sequence[int],
        *,
        backward: StageBackward | None,
        reduce_grad: Callable[[Action], None] | None = None,
        schedule: PipelineSchedule | None = None,
    ) -> dict[int, torch.Tensor]:
        """Run one step: every action of this rank (only the forward ones without
        ``backward``). ``inputs``/``labels`` hold the micro-batches on the first/last stage's
        rank (None elsewhere); ``signatures`` the input fingerprints of every micro-batch,
        the same on every rank; ``schedule`` replaces the executor's for this step (another
        number of micro-batches, for evaluation). Returns the losses of the last stage by
        micro-batch (empty on other ranks), detached."""
        step = _Step(signatures, inputs, labels, train=backward is not None)
        plan = build_plan(schedule or self.schedule, forward_only=backward is None)
        self.timeline = []
        self.boundaries.begin_step(signatures)
        # Inside the step, a peer's abandon notice ends this rank's blocked wait over the
        # network (liveness.PeerWatchdog); after it (a checkpoint saved on the way out of
        # a failure), it does not.
        with liveness.in_pipeline_step():
            try:
                for item in plan.items[self.rank]:
                    if isinstance(item, Exchange):
                        step.received.update(
                            self.boundaries.post(
                                item,
                                functools.partial(self._sent, step),
                                functools.partial(self._gradient_buffers, step),
                            )
                        )
                        self._release_sent(step, item)
                    else:
                        self._run_action(step, item, backward, reduce_grad)
            except BaseException as exc:
                # No waiting on the way out: a send whose receiver failed would wait out
                # the timeout, and its error would replace this one.
                self.boundaries.abandon_step(f"{type(exc).__name__}: {exc}")
                raise
            self.boundaries.finish_step()
        return step.losses

    def _run_action(
        self,
        step: _Step,
        action: Action,
        backward: StageBackward | None,
        reduce_grad: Callable[[Action], None] | None,
    ) -> None:
        kind = action.kind
        if kind is ActionType.FORWARD:
            self._forward(step, action)
        elif kind is ActionType.BACKWARD:
            if backward is None:
                raise InvariantError("a backward action in a forward-only step")
            self._backward(step, action, backward)
        elif kind is ActionType.REDUCE_GRAD:
            if reduce_grad is not None:
                reduce_grad(action)
        else:
            raise NotImplementedError(
                f"action {action}: the executor runs F, B, SEND/RECV and REDUCE_GRAD actions; "
                "split backward (I/W, zero-bubble schedules) is simulated but not executed yet"
            )

    # -- compute ----------------------------------------------------------------------------

    def _layer_name(self, stage: int) -> str:
        last = self.module.chunk_layers(stage)[-1]
        return f"pipeline stage {stage}: {self.module.describe_layer(last)}, the last of the stage,"

    def _stage_inputs(self, step: _Step, stage: int, m: int) -> list[torch.Tensor]:
        if stage == 0:
            if step.inputs is None:
                raise InvariantError("the first stage ran without its micro-batches")
            tensors = messages.as_tensors(step.inputs[m], f"micro-batch {m}'s inputs")
            return [t.to(self._device) for t in tensors]
        received = step.received.pop(Message(Channel.ACTIVATIONS, stage - 1, m), None)
        if received is None:
            raise InvariantError(f"stage {stage} ran F{m} before receiving its activations")
        tensors = received.wait()
        if step.train:
            for t in tensors:
                if t.dtype.is_floating_point:
                    t.requires_grad_(True)
        return tensors

    @property
    def _device(self) -> torch.device:
        return self.comm.device

    def _forward(self, step: _Step, action: Action) -> None:
        stage, m = action.stage, _micro(action)
        inputs = self._stage_inputs(step, stage, m)
        start = time.monotonic()
        chunk = stage // self.schedule.num_ranks
        with torch.set_grad_enabled(step.train):
            # Received activations are leaves that require grad (their .grad is what goes
            # back): a stage whose first layer works in place (ReLU(inplace=True), as in
            # DeepSpeed's AlexNet example) gets copies, as DeepSpeed's engine gives it.
            given = [t.clone() if t.requires_grad else t for t in inputs]
            output = self.module(messages.from_tensors(given), chunk=chunk)
            if stage == self.last_stage:
                loss = self._loss(step, output, m)
                step.losses[m] = loss.detach()
                outputs = [loss]
            else:
                outputs = messages.as_tensors(output, self._layer_name(stage))
        if step.train:
            step.stage_inputs[(stage, m)] = inputs
            step.stage_outputs[(stage, m)] = outputs
        elif stage != self.last_stage:
            step.stage_outputs[(stage, m)] = outputs  # until sent
        self._record(action, start)

    def _record(self, action: Action, start: float) -> None:
        if self.record_timeline:
            self.timeline.append((action, start, time.monotonic()))

    def _loss(self, step: _Step, output: Any, m: int) -> torch.Tensor:
        if self.loss_fn is None:
            loss = output
        else:
            if step.labels is None:
                raise InvariantError("the last stage ran without its labels")
            labels = step.labels[m]
            if isinstance(labels, torch.Tensor):
                labels = labels.to(self._device)
            elif isinstance(labels, (tuple, list)):
                labels = type(labels)(x.to(self._device) for x in labels)
            loss = self.loss_fn(output, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the last pipeline stage must produce a scalar loss (give PipelineModule a "
                f"loss_fn), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        return loss

    def _backward(self, step: _Step, action: Action, backward: StageBackward) -> None:
        stage, m = action.stage, _micro(action)
        outputs = step.stage_outputs.pop((stage, m))
        inputs = step.stage_inputs.pop((stage, m))
        if stage == self.last_stage:
            start = time.monotonic()
            backward(outputs, None, action)
        else:
            received = step.received.pop(Message(Channel.GRADIENTS, stage, m), None)
            if received is None:
                raise InvariantError(f"stage {stage} ran B{m} before receiving its gradients")
            grads = iter(received.wait())
            start = time.monotonic()
            roots, root_grads = [], []
            for out in outputs:
                if not out.dtype.is_floating_point:
                    continue
                grad = next(grads)
                if out.requires_grad:
                    roots.append(out)
                    root_grads.append(grad)
            backward(roots, root_grads, action)
        if stage > 0:
            step.input_grads[(stage, m)] = [
                (t.grad if t.grad is not None else torch.zeros_like(t)).contiguous()
                for t in inputs
                if t.dtype.is_floating_point
            ]
        self._record(action, start)

    # -- messages ---------------------------------------------------------------------------

    def _sent(self, step: _Step, message: Message) -> list[torch.Tensor]:
        """What this rank sends as ``message``: a stage's outputs, or the gradients of its
        floating-point inputs."""
        if message.channel is Channel.ACTIVATIONS:
            return step.stage_outputs[(message.stage, message.micro)]
        return step.input_grads[(message.stage + 1, message.micro)]

    def _release_sent(self, step: _Step, exchange: Exchange) -> None:
        """Forget what ``exchange`` sent and nothing else needs (the boundary holds the
        tensors until their sends complete)."""
        for transfer in exchange.transfers:
            if transfer.kind != "send":
                continue
            stage, m = transfer.message.stage, transfer.message.micro
            if transfer.message.channel is Channel.GRADIENTS:
                del step.input_grads[(stage + 1, m)]
            elif not step.train:
                del step.stage_outputs[(stage, m)]  # kept for the backward when training

    def _gradient_buffers(self, step: _Step, message: Message) -> list[torch.Tensor]:
        """Buffers for the gradients of stage ``message.stage``'s floating-point outputs."""
        outputs = step.stage_outputs[(message.stage, message.micro)]
        return [
            torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in outputs
            if t.dtype.is_floating_point
        ]


def _micro(action: Action) -> int:
    if action.microbatch is None:
        raise InvariantError(f"action {action} has no micro-batch")
    return action.microbatch

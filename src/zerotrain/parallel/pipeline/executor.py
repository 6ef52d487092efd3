"""Running one rank's instruction list: forwards, backwards and the messages between stages.

The schedule (``schedules.py``) says what this rank does and in which order; the executor
does it. Compute actions call the stage module (``F``) and autograd (``B``); communication
actions post tagged, non-blocking messages to the neighbouring stages' ranks through the pipe
communicator (``Communicator.post``): a receive is waited for by the action that consumes
it, sends are waited for at the end of the step. Because a send never waits for its
receiver and messages match by tag, any schedule the simulator accepts runs without
deadlock, whatever order two ranks post their messages to each other in.

Shapes and dtypes. A receiver allocates its buffers before the data arrives, so it must know
them. At the start of each step the first stage's rank tells the whole pipeline a
fingerprint of every micro-batch's input shapes (one small broadcast); the first time a
stage sends activations for a fingerprint it has not sent before, it sends their
description first, and the receiver, which saw the same fingerprints, expects one exactly
then. So descriptions move on the first micro-batch and again whenever the input shapes
change (a longer curriculum sequence, a short last batch), and a pipeline whose inputs keep
one shape sends none after its first step. A stage whose output shapes depend on the values
of its inputs, not only their shapes, is not supported: its receiver's buffers would not
match, which the receive reports.

Gradients flow back for the floating-point tensors of a boundary (zeros where the next stage
did not use one); integer and bool tensors cross as themselves and get none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import Handle
from zerotrain.comm.p2p import P2POp
from zerotrain.parallel.pipeline import messages
from zerotrain.parallel.pipeline.messages import Channel, TensorMeta
from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.utils.invariant import InvariantError

FORWARD_ONLY = (ActionType.FORWARD, ActionType.SEND_F, ActionType.RECV_F)


class StageBackward(Protocol):
    """Runs autograd for one backward action (the engine's side: loss scaling, ZeRO's
    gradient-sync knobs). ``grads`` is None for the last stage, whose ``roots`` is the
    micro-batch's loss."""

    def __call__(
        self, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None, action: Action
    ) -> None: ...


@dataclass
class _Received:
    """Buffers a receive writes into, and its handle."""

    handle: Handle
    tensors: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        self.handle.wait()
        return self.tensors


@dataclass
class _Step:
    """What one step keeps between its actions."""

    signatures: Sequence[int]
    inputs: Sequence[Any] | None
    labels: Sequence[Any] | None
    train: bool
    received: dict[tuple[Channel, int, int], _Received] = field(default_factory=dict)
    # Per (stage, micro-batch): the stage's inputs (leaves) and outputs, until its backward.
    stage_inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    stage_outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Handle, list[torch.Tensor]]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


class PipelineExecutor:
    """Runs this rank's actions of ``schedule`` over ``comm`` (the pipe communicator).

    Args:
        module: this rank's stage module; ``module(x, chunk=k)`` runs its k-th local chunk
            (virtual stage ``rank + k * P``) and ``module.chunk_layers(stage)`` names the
            global layer indices of a stage (for error messages).
        comm: the ranks of this pipeline, in stage order.
        schedule: the instruction lists, with communication actions.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        schedule: PipelineSchedule,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> None:
        if schedule.num_ranks != comm.world_size:
            raise ValueError(
                f"the schedule has {schedule.num_ranks} ranks, the pipeline {comm.world_size}"
            )
        self.module = module
        self.comm = comm
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.rank = comm.rank
        self.last_stage = schedule.num_stages - 1
        # (action, start, end) of each compute action of the last step, in time.monotonic()
        # seconds (one clock for every process of a machine), when ``record_timeline``;
        # from when its inputs (or gradients) had arrived to when it was done.
        self.record_timeline = False
        self.timeline: list[tuple[Action, float, float]] = []
        self._described: set[tuple[int, int]] = set()  # (sending stage, input fingerprint)
        self._descriptions: dict[tuple[int, int], tuple[TensorMeta, ...]] = {}

    # -- the step ---------------------------------------------------------------------------

    def run(
        self,
        inputs: Sequence[Any] | None,
        labels: Sequence[Any] | None,
        signatures: Sequence[int],
        *,
        backward: StageBackward | None,
        reduce_grad: Callable[[Action], None] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Run one step: every action of this rank (only the forward ones without
        ``backward``). ``inputs``/``labels`` hold the micro-batches on the first/last stage's
        rank (None elsewhere); ``signatures`` the input fingerprints of every micro-batch,
        the same on every rank. Returns the losses of the last stage by micro-batch (empty
        on other ranks), detached."""
        step = _Step(signatures, inputs, labels, train=backward is not None)
        actions = self.schedule.actions[self.rank]
        if backward is None:
            actions = tuple(a for a in actions if a.kind in FORWARD_ONLY)
        self.timeline = []
        try:
            for action in actions:
                self._run_action(step, action, backward, reduce_grad)
        finally:
            for handle, _ in step.sends:
                handle.wait()
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
        elif kind is ActionType.SEND_F:
            self._send_activations(step, action)
        elif kind is ActionType.RECV_F:
            self._receive_activations(step, action)
        elif kind is ActionType.SEND_B:
            self._send_gradients(step, action)
        elif kind is ActionType.RECV_B:
            self._receive_gradients(step, action)
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
        layers = self.module.chunk_layers(stage)  # type: ignore[operator]
        last = layers[-1] if len(layers) else None
        built = getattr(self.module, str(last), None) if last is not None else None
        what = f" ({type(built).__name__})" if isinstance(built, nn.Module) else ""
        return f"pipeline stage {stage}: layer {last}{what}, the last of the stage,"

    def _stage_inputs(self, step: _Step, stage: int, m: int) -> list[torch.Tensor]:
        if stage == 0:
            if step.inputs is None:
                raise InvariantError("the first stage ran without its micro-batches")
            tensors = messages.as_tensors(step.inputs[m], f"micro-batch {m}'s inputs")
            return [t.to(self._device) for t in tensors]
        received = step.received.pop((Channel.ACTIVATIONS, stage, m), None)
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
            output = self.module(messages.from_tensors(inputs), chunk=chunk)
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
            received = step.received.pop((Channel.GRADIENTS, stage, m), None)
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

    def _peer(self, stage: int) -> int:
        return self.schedule.stage_to_rank(stage)

    def _post(self, ops: list[P2POp]) -> Handle:
        return self.comm.post(ops)

    def _send_activations(self, step: _Step, action: Action) -> None:
        stage, m = action.stage, _micro(action)
        outputs = [t.detach().contiguous() for t in step.stage_outputs[(stage, m)]]
        if not step.train:
            del step.stage_outputs[(stage, m)]
        peer = self._peer(stage + 1)
        ops: list[P2POp] = []
        key = (stage, step.signatures[m])
        if key not in self._described:
            where = f"{self._layer_name(stage)} output"
            description = messages.encode(messages.describe(outputs), where)
            self._described.add(key)
            self._descriptions[key] = messages.describe(outputs)
            ops.append(
                P2POp.send(
                    description,
                    peer,
                    purpose="stage_shapes",
                    label=f"stage {stage} description",
                    tag=messages.tag(Channel.DESCRIPTION, stage, m),
                )
            )
            outputs_kept = [description, *outputs]
        else:
            expected = self._descriptions[key]
            if messages.describe(outputs) != expected:
                raise RuntimeError(
                    f"{self._layer_name(stage)} output shapes {messages.describe(outputs)} "
                    f"differ from {expected}, which it produced before for inputs of the same "
                    "shapes: a stage's output shapes must depend only on its input shapes"
                )
            outputs_kept = list(outputs)
        for slot, t in enumerate(outputs):
            ops.append(
                P2POp.send(
                    t,
                    peer,
                    purpose="activations",
                    label=f"F{m}",
                    tag=messages.tag(Channel.ACTIVATIONS, stage, m, slot),
                )
            )
        step.sends.append((self._post(ops), outputs_kept))

    def _receive_activations(self, step: _Step, action: Action) -> None:
        stage, m = action.stage, _micro(action)
        sender = stage - 1
        peer = self._peer(sender)
        key = (sender, step.signatures[m])
        if key not in self._descriptions:
            message = torch.empty(messages.DESCRIPTION_NUMEL, dtype=torch.int64)
            description_tag = messages.tag(Channel.DESCRIPTION, sender, m)
            self._post(
                [
                    P2POp.recv(
                        message,
                        peer,
                        purpose="stage_shapes",
                        label=f"stage {sender} description",
                        tag=description_tag,
                    )
                ]
            ).wait()
            self._descriptions[key] = messages.decode(message)
        metas = self._descriptions[key]
        buffers = [meta.empty(self._device) for meta in metas]
        ops = [
            P2POp.recv(
                t,
                peer,
                purpose="activations",
                label=f"F{m}",
                tag=messages.tag(Channel.ACTIVATIONS, sender, m, slot),
            )
            for slot, t in enumerate(buffers)
        ]
        step.received[(Channel.ACTIVATIONS, stage, m)] = _Received(self._post(ops), buffers)

    def _send_gradients(self, step: _Step, action: Action) -> None:
        stage, m = action.stage, _micro(action)
        grads = step.input_grads.pop((stage, m))
        peer = self._peer(stage - 1)
        ops = [
            P2POp.send(
                g,
                peer,
                purpose="activation_gradients",
                label=f"B{m}",
                tag=messages.tag(Channel.GRADIENTS, stage - 1, m, slot),
            )
            for slot, g in enumerate(grads)
        ]
        step.sends.append((self._post(ops), grads))

    def _receive_gradients(self, step: _Step, action: Action) -> None:
        stage, m = action.stage, _micro(action)
        outputs = step.stage_outputs[(stage, m)]
        buffers = [
            torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in outputs
            if t.dtype.is_floating_point
        ]
        peer = self._peer(stage + 1)
        ops = [
            P2POp.recv(
                g,
                peer,
                purpose="activation_gradients",
                label=f"B{m}",
                tag=messages.tag(Channel.GRADIENTS, stage, m, slot),
            )
            for slot, g in enumerate(buffers)
        ]
        step.received[(Channel.GRADIENTS, stage, m)] = _Received(self._post(ops), buffers)


def _micro(action: Action) -> int:
    if action.microbatch is None:
        raise InvariantError(f"action {action} has no micro-batch")
    return action.microbatch

"""The messages of one rank's stage boundaries: activations forward, gradients back.

Every message is posted tagged and non-blocking through the pipe communicator
(``Communicator.post``): a receive is waited for by the action that consumes it, a send is
held (with its tensors) until it completed, released as soon as it did, and the step waits
for the rest at its end.

Shapes and dtypes. A receiver allocates its buffers before the data arrives, so it must know
them. At the start of each step the first stage's rank tells the whole pipeline a
fingerprint of every micro-batch's input shapes (one small broadcast, by the engine); the
first time a stage sends activations for a fingerprint it has not sent before, it sends
their description first, and the receiver, which saw the same fingerprints, expects one
exactly then. So descriptions move on the first micro-batch and again whenever the input
shapes change (a longer curriculum sequence, a short last batch), and a pipeline whose
inputs keep one shape sends none after its first step. A stage whose output shapes depend
on the values of its inputs, not only their shapes, is not supported: the sender notices
and raises.

Gradients flow back for the floating-point tensors of a boundary (the receiver knows their
shapes: they are those of what it sent); integer and bool tensors get none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import Handle
from zerotrain.comm.p2p import P2POp
from zerotrain.parallel.pipeline import messages
from zerotrain.parallel.pipeline.messages import Channel, TensorMeta


@dataclass
class Received:
    """Buffers a receive writes into, and its handle; or, when a description of the shapes
    must arrive first, the description's handle and how to post the rest once it has."""

    handle: Handle
    tensors: list[torch.Tensor]
    then: Callable[[], Received] | None = None

    def wait(self) -> list[torch.Tensor]:
        """The received tensors, once they arrived."""
        self.handle.wait()
        if self.then is not None:
            return self.then().wait()
        return self.tensors


class StageBoundaries:
    """Posts this rank's boundary messages.

    Args:
        comm: the pipe communicator (its ranks are pipeline ranks).
        stage_to_rank: the pipeline rank holding a (virtual) stage.
        layer_name: how errors name the last layer of a stage.
    """

    def __init__(
        self,
        comm: Communicator,
        stage_to_rank: Callable[[int], int],
        layer_name: Callable[[int], str],
    ) -> None:
        self.comm = comm
        self._rank_of = stage_to_rank
        self._layer_name = layer_name
        self._signatures: Sequence[int] = ()
        # Descriptions by (sending stage, input fingerprint): the ones this rank sent, and
        # the ones it knows (sent or received).
        self._described: set[tuple[int, int]] = set()
        self._known: dict[tuple[int, int], tuple[TensorMeta, ...]] = {}
        # Descriptions on their way (their receive's handle and buffer).
        self._pending: dict[tuple[int, int], tuple[Handle, torch.Tensor]] = {}
        self._in_flight: list[tuple[Handle, list[torch.Tensor]]] = []
        # Messages of failed steps, never waited for: their buffers must outlive them.
        self._abandoned: list[tuple[Handle, list[torch.Tensor]]] = []

    def begin_step(self, signatures: Sequence[int]) -> None:
        """The input fingerprints of this step's micro-batches (the same on every rank)."""
        self._signatures = signatures

    def finish_step(self) -> None:
        """Wait for every send still in flight."""
        in_flight, self._in_flight = self._in_flight, []
        for handle, _ in in_flight:
            handle.wait()

    def abandon_step(self) -> None:
        """The step failed: keep the sends still in flight (and their tensors, which the
        backend may still read) without waiting for them, and forget descriptions on their
        way; the engine refuses further steps."""
        self._abandoned += self._in_flight
        self._in_flight = []
        self._pending.clear()

    def _hold(self, handle: Handle, tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` until their send completed; finished sends release theirs now,
        so what a step holds is what is in flight, not every micro-batch's tensors."""
        in_flight = []
        for sent, kept in self._in_flight:
            if sent.done():
                sent.wait()  # returns at once, or raises the send's error here
            else:
                in_flight.append((sent, kept))
        self._in_flight = [*in_flight, (handle, tensors)]

    def send_activations(self, stage: int, m: int, outputs: Sequence[torch.Tensor]) -> None:
        """Stage ``stage``'s outputs for micro-batch ``m`` to the next stage."""
        tensors = [t.detach().contiguous() for t in outputs]
        peer = self._rank_of(stage + 1)
        ops: list[P2POp] = []
        key = (stage, self._signatures[m])
        metas = messages.describe(tensors)
        if key not in self._described:
            where = f"{self._layer_name(stage)} output"
            description, problem = messages.encode_or_refuse(metas, where)
            self._known[key] = metas
            tag = messages.tag(Channel.DESCRIPTION, stage, m)
            label = f"stage {stage} description"
            send = P2POp.send(description, peer, purpose="stage_shapes", label=label, tag=tag)
            # Posted before the tensors' own checks: a boundary the tags cannot carry is
            # then refused by the receiver too, from the description, instead of leaving it
            # waiting for one.
            self._hold(self.comm.post([send]), [description])
            if problem is not None:
                raise problem
            self._described.add(key)
            held = tensors
        elif metas != self._known[key]:
            raise RuntimeError(
                f"{self._layer_name(stage)} output shapes {metas} differ from "
                f"{self._known[key]}, which it produced before for inputs of the same shapes: "
                "a stage's output shapes must depend only on its input shapes"
            )
        else:
            held = tensors
        for slot, t in enumerate(tensors):
            tag = messages.tag(Channel.ACTIVATIONS, stage, m, slot)
            ops.append(P2POp.send(t, peer, purpose="activations", label=f"F{m}", tag=tag))
        self._hold(self.comm.post(ops), held)

    def receive_activations(self, stage: int, m: int) -> Received:
        """Post the receive of stage ``stage``'s inputs for micro-batch ``m`` (never waits:
        when their description must come first, the data's receive is posted once it
        arrived, by ``Received.wait``)."""
        sender = stage - 1
        key = (sender, self._signatures[m])
        if key in self._known:
            return self._receive_described(stage, m)
        if key not in self._pending:
            # The first micro-batch with these shapes: its description comes first.
            message = torch.empty(messages.DESCRIPTION_NUMEL, dtype=torch.int64)
            tag = messages.tag(Channel.DESCRIPTION, sender, m)
            label = f"stage {sender} description"
            peer = self._rank_of(sender)
            op = P2POp.recv(message, peer, purpose="stage_shapes", label=label, tag=tag)
            self._pending[key] = (self.comm.post([op]), message)
        handle, message = self._pending[key]

        def then() -> Received:
            if key in self._pending:  # the first of the micro-batches waiting for it
                handle.wait()
                where = f"{self._layer_name(sender)} output"
                self._known[key] = messages.decode(self._pending.pop(key)[1], where)
            return self._receive_described(stage, m)

        return Received(handle, [], then)

    def _receive_described(self, stage: int, m: int) -> Received:
        sender = stage - 1
        peer = self._rank_of(sender)
        buffers = [
            meta.empty(self.comm.device) for meta in self._known[(sender, self._signatures[m])]
        ]
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
        return Received(self.comm.post(ops), buffers)

    def send_gradients(self, stage: int, m: int, grads: list[torch.Tensor]) -> None:
        """The gradients of stage ``stage``'s floating-point inputs, to the stage before."""
        peer = self._rank_of(stage - 1)
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
        self._hold(self.comm.post(ops), grads)

    def receive_gradients(self, stage: int, m: int, outputs: Sequence[torch.Tensor]) -> Received:
        """Post the receive of the gradients of ``outputs`` (stage ``stage``'s, micro-batch
        ``m``; one per floating-point tensor)."""
        buffers = [
            torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in outputs
            if t.dtype.is_floating_point
        ]
        peer = self._rank_of(stage + 1)
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
        return Received(self.comm.post(ops), buffers)

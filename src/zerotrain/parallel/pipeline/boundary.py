"""The messages of one rank's stage boundaries: activations forward, gradients back.

The executor hands over one :class:`~zerotrain.parallel.pipeline.plan.Exchange` at a time,
in the plan's order, with the tensors its sends carry; this module posts it through the pipe
communicator's one ordered entry point (``Communicator.post_in_order``): NCCL, and gloo in
``ZEROTRAIN_P2P_MATCH=order``, match messages between two ranks by posting order, which the
plan keeps mirrored. A receive is waited for by the action that consumes it; a send is held
(with its tensors) until it completed, released as soon as it did, and the step waits for
the rest at its end (a failed step leaves them, without waiting).

Shapes and dtypes. A receiver allocates its buffers before the data arrives, so it must know
them. At the start of each step the first stage's rank tells the whole pipeline a
fingerprint of every micro-batch's input shapes (one small broadcast, by the engine); the
first time a stage sends activations for a fingerprint it has not sent before, a description
of their shapes and dtypes goes ahead of them in the same exchange, and the receiver, which
saw the same fingerprints, expects one exactly then: it posts the exchange's descriptions,
waits for the ones it receives, and posts the data after. So descriptions move on the first
micro-batch and again whenever the input shapes change (a longer curriculum sequence, a short
last batch), and a pipeline whose inputs keep one shape sends none after its first step.
Descriptions live on the pipe's device (NCCL moves device tensors); decoding one costs a host
sync, only then. A stage whose output shapes depend on the values of its inputs, not only
their shapes, is not supported: the sender notices and raises.

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
from zerotrain.parallel.pipeline.plan import Exchange, Message, Transfer


@dataclass
class Received:
    """Buffers a receive writes into, and their handles."""

    handles: list[Handle]
    tensors: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        """The received tensors, once they arrived."""
        for handle in self.handles:
            handle.wait()
        return self.tensors


class StageBoundaries:
    """Posts this rank's boundary messages.

    Args:
        comm: the pipe communicator (its ranks are pipeline ranks).
        layer_name: how errors name the last layer of a stage.
    """

    def __init__(self, comm: Communicator, layer_name: Callable[[int], str]) -> None:
        self.comm = comm
        self._layer_name = layer_name
        self._signatures: Sequence[int] = ()
        # Descriptions by (sending stage, input fingerprint): the ones this rank sent, and
        # the ones it knows (sent or received).
        self._described: set[tuple[int, int]] = set()
        self._known: dict[tuple[int, int], tuple[TensorMeta, ...]] = {}
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

    def abandon_step(self, reason: str) -> None:
        """The step failed with ``reason``: keep the sends still in flight (and their
        tensors, which the backend may still read) without waiting for them, and tell the
        peers on this machine, whose waits on this rank then raise at once quoting
        ``reason`` (``Communicator.abandon_posted``); the engine refuses further steps."""
        self._abandoned += self._in_flight
        self._in_flight = []
        self.comm.abandon_posted(reason)

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

    def post(
        self,
        exchange: Exchange,
        sent: Callable[[Message], list[torch.Tensor]],
        gradient_buffers: Callable[[Message], list[torch.Tensor]],
    ) -> dict[Message, Received]:
        """Post ``exchange``: its descriptions first (waiting for those it receives), then
        its data. ``sent`` gives the tensors of a message this rank sends;
        ``gradient_buffers`` the buffers of gradients it receives (shaped like the outputs
        they belong to). Returns the receives by message."""
        problem = self._post_descriptions(exchange, sent)
        entries: list[tuple[Transfer, list[torch.Tensor]]] = []
        for transfer in exchange.transfers:
            message = transfer.message
            if transfer.kind == "send":
                tensors = [t.detach().contiguous() for t in sent(message)]
            elif message.channel is Channel.ACTIVATIONS:
                metas = self._known[(message.stage, self._signatures[message.micro])]
                tensors = [meta.empty(self.comm.device) for meta in metas]
            else:
                tensors = gradient_buffers(message)
            entries.append((transfer, tensors))
        if problem is not None:  # its receiver was told so, by the description
            raise problem
        ops = [self._op(t, x, slot) for t, tensors in entries for slot, x in enumerate(tensors)]
        handles = iter(self.comm.post_in_order(ops))
        received: dict[Message, Received] = {}
        for transfer, tensors in entries:
            mine = [next(handles) for _ in tensors]
            if transfer.kind == "send":
                for handle in mine:
                    self._hold(handle, tensors)
            else:
                received[transfer.message] = Received(mine, tensors)
        return received

    def _op(self, transfer: Transfer, tensor: torch.Tensor, slot: int) -> P2POp:
        message = transfer.message
        # The stage in the label tells apart the chunks an interleaved pair exchanges.
        if message.channel is Channel.ACTIVATIONS:
            purpose, label = "activations", f"stage {message.stage} F{message.micro}"
        else:
            purpose, label = "activation_gradients", f"stage {message.stage} B{message.micro}"
        tag = messages.tag(message.channel, message.stage, message.micro, slot)
        make = P2POp.send if transfer.kind == "send" else P2POp.recv
        return make(tensor.contiguous(), transfer.peer, purpose=purpose, label=label, tag=tag)

    def _post_descriptions(
        self, exchange: Exchange, sent: Callable[[Message], list[torch.Tensor]]
    ) -> Exception | None:
        """Post the descriptions of ``exchange`` (activations with input shapes not
        described before) and wait for the ones this rank receives. Returns the error of a
        description this rank could not make (after telling its receiver)."""
        ops: list[P2POp] = []
        problem: Exception | None = None
        incoming: list[tuple[tuple[int, int], torch.Tensor]] = []
        for transfer in exchange.transfers:
            message = transfer.message
            if message.channel is not Channel.ACTIVATIONS:
                continue
            key = (message.stage, self._signatures[message.micro])
            tag = messages.tag(Channel.DESCRIPTION, message.stage, message.micro)
            label = f"stage {message.stage} description"
            if transfer.kind == "send":
                metas = messages.describe(sent(message))
                if key in self._described:
                    self._check_same_shapes(message.stage, key, metas)
                    continue
                where = f"{self._layer_name(message.stage)} output"
                description, failed = messages.encode_or_refuse(metas, where)
                problem = problem or failed
                self._described.add(key)
                self._known[key] = metas
                ops.append(
                    P2POp.send(
                        description.to(self.comm.device),
                        transfer.peer,
                        purpose="stage_shapes",
                        label=label,
                        tag=tag,
                    )
                )
            elif key not in self._known and key not in {k for k, _ in incoming}:
                into = torch.empty(
                    messages.DESCRIPTION_NUMEL, dtype=torch.int64, device=self.comm.device
                )
                ops.append(
                    P2POp.recv(into, transfer.peer, purpose="stage_shapes", label=label, tag=tag)
                )
                incoming.append((key, into))
        if not ops:
            return problem
        handles = self.comm.post_in_order(ops)
        for handle, op in zip(handles, ops, strict=True):
            if op.kind == "send":
                self._hold(handle, [op.tensor])
        receives = [h for h, op in zip(handles, ops, strict=True) if op.kind == "recv"]
        for (key, into), handle in zip(incoming, receives, strict=True):
            handle.wait()
            self._known[key] = messages.decode(into, f"{self._layer_name(key[0])} output")
        return problem

    def _check_same_shapes(
        self, stage: int, key: tuple[int, int], metas: tuple[TensorMeta, ...]
    ) -> None:
        if metas != self._known[key]:
            raise RuntimeError(
                f"{self._layer_name(stage)} output shapes {metas} differ from "
                f"{self._known[key]}, which it produced before for inputs of the same shapes: "
                "a stage's output shapes must depend only on its input shapes"
            )

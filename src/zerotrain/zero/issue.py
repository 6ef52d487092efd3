"""Issuing what a unit described (``shard.io.CollectiveIO``) over a communicator."""

from __future__ import annotations

import contextlib

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.shard.io import CollectiveIO
from zerotrain.utils.torch_compat import preserve_version_counter


def issue(comm: Communicator, io: CollectiveIO, *, async_op: bool = True) -> Handle:
    """Start ``io`` over ``comm``; its ``on_done`` runs when the returned handle is waited
    on (at once when ``async_op`` is False)."""
    guard = preserve_version_counter(io.output) if io.keep_version else contextlib.nullcontext()
    purpose, done, label = io.purpose, io.on_done, io.label
    with guard:
        if io.op == "all_gather":
            return comm.all_gather_into(
                io.output, io.input, purpose=purpose, async_op=async_op, on_done=done, label=label
            )
        if io.op == "reduce_scatter":
            return comm.reduce_scatter(
                io.output, io.input, purpose=purpose, async_op=async_op, on_done=done, label=label
            )
        return comm.all_reduce(
            io.output, purpose=purpose, async_op=async_op, on_done=done, label=label
        )

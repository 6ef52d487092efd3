"""The stage-3 storage's state machine: every transition checked, illegal ones refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.partitioned import PartitionedParams, ShardState
from zerotrain.utils.invariant import InvariantError


def _storage() -> PartitionedParams:
    params = [nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.ones(4))]
    layout = FlatLayout.pack([("a", (3, 2)), ("b", (4,))], world_size=2)
    shard = torch.arange(float(layout.shard_numel))
    return PartitionedParams(layout, params, 0, shard)


def _gather(storage: PartitionedParams) -> None:
    io = storage.unshard("unit")
    assert storage.state is ShardState.GATHERING
    io.output[: io.input.numel()].copy_(io.input)  # what the all-gather would do
    assert io.on_done is not None
    io.on_done()


def test_the_unit_cycle_through_gather_pin_and_free():
    storage = _storage()
    assert storage.state is ShardState.SHARDED
    assert storage.params[0].shape == (0,)
    _gather(storage)
    assert storage.state is ShardState.GATHERED
    assert storage.params[0].shape == (3, 2)
    storage.pin()
    storage.pin()
    assert not storage.freeable
    storage.unpin()
    assert storage.state is ShardState.PINNED
    storage.unpin()
    assert storage.freeable
    storage.free()
    assert storage.state is ShardState.SHARDED
    assert storage.params[0].shape == (0,)


def test_persistent_units_ignore_pins_and_are_only_detached():
    storage = _storage()
    _gather(storage)
    storage.make_persistent()
    storage.pin()
    storage.unpin()
    assert storage.state is ShardState.PERSISTENT
    with pytest.raises(InvariantError, match="persistent cannot become sharded"):
        storage.free()
    storage.detach()
    assert storage.state is ShardState.DETACHED


@pytest.mark.parametrize(
    ("setup", "action", "message"),
    [
        ("sharded", lambda s: s.free(), "sharded cannot become sharded"),
        ("sharded", lambda s: s.unpin(), "unpin without pin"),
        ("gathering", lambda s: s.unshard("unit"), "gathering cannot become gathering"),
        ("gathering", lambda s: s.free(), "gathering cannot become sharded"),
        ("gathered", lambda s: s.unshard("unit"), "gathered cannot become gathering"),
        ("detached", lambda s: s.unshard("unit"), "detached cannot become gathering"),
    ],
)
def test_illegal_transitions_raise(setup, action, message):
    storage = _storage()
    if setup == "gathering":
        storage.unshard("unit")
    elif setup == "gathered":
        _gather(storage)
    elif setup == "detached":
        storage.detach()
    with pytest.raises(InvariantError, match=message):
        action(storage)

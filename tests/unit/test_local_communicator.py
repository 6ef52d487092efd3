"""The one-rank communicator: collectives are local copies, still counted."""

from __future__ import annotations

import pytest
import torch

from zerotrain.comm.local import LocalCommunicator


def test_collectives_over_one_rank_are_copies_and_are_counted():
    comm = LocalCommunicator(torch.device("cpu"))
    values = torch.arange(4.0)
    comm.all_reduce(values, purpose="control")
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0]
    out = torch.zeros(4)
    comm.reduce_scatter(out, values, purpose="gradients")
    assert torch.equal(out, values)
    gathered = torch.zeros(4)
    comm.all_gather_into(gathered, values, purpose="parameters")
    assert torch.equal(gathered, values)
    comm.broadcast(values, src=0, purpose="init")
    assert comm.all_reduce_floats([2.5], op="max") == [2.5]
    comm.barrier()
    stats = comm.snapshot()
    assert stats.get(op="reduce_scatter").payload_bytes == 16
    assert stats.get(op="all_gather").calls == 1
    assert stats.get(op="all_reduce").calls == 2
    assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "local")


def test_all_to_all_is_a_copy_and_point_to_point_has_no_peer():
    comm = LocalCommunicator(torch.device("cpu"))
    rows = torch.arange(6.0).view(3, 2)
    out = torch.zeros(3, 2)
    comm.all_to_all(out, rows, input_split_sizes=[3], output_split_sizes=[3], purpose="data")
    assert torch.equal(out, rows)
    with pytest.raises(ValueError, match="only split"):
        comm.all_to_all(out, rows, input_split_sizes=[1, 2], purpose="data")
    with pytest.raises(ValueError, match="no other rank"):
        comm.send(rows, 0, purpose="activations")


def test_a_broadcast_from_another_rank_is_refused():
    with pytest.raises(ValueError, match="group of one rank"):
        LocalCommunicator(torch.device("cpu")).broadcast(torch.zeros(1), src=1, purpose="init")

"""Megatron-style tensor-parallel layers equal the dense layers they are cut from.

Each case builds a dense module, cuts it into this rank's slices with ``from_dense``, and
checks on 2 and 4 ranks (gloo) that the outputs, the input gradients and every slice's
weight gradients equal the dense module's (the matching slice), and that the sums cross the
group as often as Megatron's analysis says: an MLP block (column then row) all-reduces once
forward and once backward. With Megatron sequence parallelism (the block entered by an
all-gather of sequence slices and left by a reduce-scatter) the block still equals the dense
one, provided the gradients of the parameters whole on every rank (the LayerNorm, the row
bias) are summed over the group; without that sum they are silently wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.regions import all_gather_along, reduce_scatter_along
from zerotrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from zerotrain.testing.dist import run_distributed

B, S, H = 2, 4, 8


def _chunk(t: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    return t.chunk(comm.world_size, dim=dim)[comm.rank]


def _mlp_block() -> dict:
    comm = Communicator()
    torch.manual_seed(0)
    fc, proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    x = torch.randn(B, S, H, requires_grad=True)
    dense = proj(F.gelu(fc(x)))
    dense.pow(2).sum().backward()

    col, row = ColumnParallelLinear.from_dense(fc, comm), RowParallelLinear.from_dense(proj, comm)
    xt = x.detach().clone().requires_grad_(True)
    comm.stats.reset()
    out = row(F.gelu(col(xt)))
    forward = comm.snapshot().get(op="all_reduce", purpose="activations")
    out.pow(2).sum().backward()
    backward = comm.snapshot().get(op="all_reduce", purpose="activation_gradients")
    checks = {
        "output": (out, dense),
        "input grad": (xt.grad, x.grad),
        "column weight grad": (col.weight.grad, _chunk(fc.weight.grad, comm, 0)),
        "column bias grad": (col.bias.grad, _chunk(fc.bias.grad, comm, 0)),
        "row weight grad": (row.weight.grad, _chunk(proj.weight.grad, comm, 1)),
        "row bias grad": (row.bias.grad, proj.bias.grad),
    }
    return {
        "errors": {k: (a - b).abs().max().item() for k, (a, b) in checks.items()},
        "forward": (forward.calls, forward.payload_bytes),
        "backward": (backward.calls, backward.payload_bytes),
        "weight_numel": col.weight.numel() + row.weight.numel(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_column_then_row_equals_the_dense_mlp_with_one_sum_each_way(world):
    for rank, got in enumerate(run_distributed(_mlp_block, world, timeout=120)):
        assert max(got["errors"].values()) < 1e-5, (rank, got["errors"])
        # One all-reduce of the block's output (b * s * h floats) forward, one of the
        # input's gradient backward: Megatron's count for an MLP block.
        assert got["forward"] == (1, B * S * H * 4), got
        assert got["backward"] == (1, B * S * H * 4), got
        assert got["weight_numel"] * world == 2 * 4 * H * H


def _gathered_and_scattered() -> dict:
    comm = Communicator()
    torch.manual_seed(1)
    fc, proj = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
    x = torch.randn(B, H, requires_grad=True)
    dense = proj(fc(x))
    dense.sum().backward()
    col = ColumnParallelLinear.from_dense(fc, comm, gather_output=True)
    row = RowParallelLinear.from_dense(proj, comm, input_is_parallel=False)
    xt = x.detach().clone().requires_grad_(True)
    out = row(col(xt))
    out.sum().backward()
    return {
        "output": (out - dense).abs().max().item(),
        "input grad": (xt.grad - x.grad).abs().max().item(),
        "column weight grad": (col.weight.grad - _chunk(fc.weight.grad, comm, 0))
        .abs()
        .max()
        .item(),
    }


def test_gathered_output_and_whole_input_variants():
    for got in run_distributed(_gathered_and_scattered, 2, timeout=120):
        assert max(got.values()) < 1e-5, got


def _vocab_parallel() -> dict:
    comm = Communicator()
    torch.manual_seed(2)
    vocab = 12
    embedding, head = nn.Embedding(vocab, H), nn.Linear(H, vocab, bias=False)
    ids = torch.randint(0, vocab, (B, S))
    targets = torch.randint(0, vocab, (B, S))
    dense_logits = head(embedding(ids))
    dense = F.cross_entropy(dense_logits.view(-1, vocab), targets.view(-1))
    dense.backward()

    emb = VocabParallelEmbedding.from_dense(embedding, comm)
    col = ColumnParallelLinear.from_dense(head, comm)  # logits split over the vocabulary
    loss = vocab_parallel_cross_entropy(col(emb(ids)), targets, comm).mean()
    loss.backward()
    return {
        "loss": abs(loss.item() - dense.item()),
        "embedding grad": (emb.weight.grad - _chunk(embedding.weight.grad, comm, 0))
        .abs()
        .max()
        .item(),
        "head grad": (col.weight.grad - _chunk(head.weight.grad, comm, 0)).abs().max().item(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_equal_the_dense_ones(world):
    for got in run_distributed(_vocab_parallel, world, timeout=120):
        assert max(got.values()) < 1e-5, got


def _sequence_regions() -> dict:
    comm = Communicator()
    torch.manual_seed(3)
    x = torch.randn(S * comm.world_size, B, H, requires_grad=True)  # (sequence, batch, hidden)
    whole = x.detach().clone().requires_grad_(True)
    # Each rank holds its slice of the sequence; the region gathers it, computes on the whole
    # sequence, and leaves it reduce-scattered: equal to summing the ranks' contributions.
    mine = _chunk(whole, comm, 0).detach().clone().requires_grad_(True)
    gathered = all_gather_along(mine, comm, 0)
    weight = torch.full((H,), float(comm.rank + 1))
    partial = gathered * weight  # rank r's part of a row-parallel output
    out = reduce_scatter_along(partial, comm, 0)
    out.pow(2).sum().backward()
    total = sum(range(1, comm.world_size + 1))
    expected = _chunk(whole.detach() * total, comm, 0)
    # d/dx of sum((x * total)^2) over the whole sequence, this rank's slice.
    expected_grad = _chunk(2 * whole.detach() * total * total, comm, 0)
    return {
        "output": (out - expected).abs().max().item(),
        "grad": (mine.grad - expected_grad).abs().max().item(),
        "shape": list(out.shape),
    }


def test_sequence_parallel_regions_gather_and_reduce_scatter():
    for got in run_distributed(_sequence_regions, 2, timeout=120):
        assert got["shape"] == [S, B, H]
        assert got["output"] < 1e-5, got
        assert got["grad"] < 1e-4, got


def _uneven() -> str:
    comm = Communicator()
    try:
        ColumnParallelLinear.from_dense(nn.Linear(4, 6), comm)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_an_uneven_split_names_the_layer():
    message = run_distributed(_uneven, 4, timeout=60)[0]
    assert "ColumnParallelLinear out_features = 6" in message, message


def _sequence_parallel_block(sum_norm_grads: bool) -> dict:
    from zerotrain.parallel.tensor import sum_gradients_over_group

    comm = Communicator()
    torch.manual_seed(6)
    seq = S * comm.world_size
    norm, fc, proj = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
    with torch.no_grad():  # not the identity, so its gradient matters
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(seq, B, H, requires_grad=True)
    dense = x + proj(F.gelu(fc(norm(x))))
    dense.pow(2).sum().backward()

    sp_norm = nn.LayerNorm(H)
    sp_norm.load_state_dict(norm.state_dict())
    col = ColumnParallelLinear.from_dense(fc, comm, sequence_dim=0)
    row = RowParallelLinear.from_dense(proj, comm, sequence_dim=0)
    if sum_norm_grads:
        sum_gradients_over_group([*sp_norm.parameters(), row.bias], comm)  # the whole ones
    mine = _chunk(x.detach(), comm, 0).clone().requires_grad_(True)  # this rank's positions
    out = mine + row(F.gelu(col(sp_norm(mine))))  # the block gathers, then reduce-scatters
    out.pow(2).sum().backward()
    return {
        "output": (out - _chunk(dense, comm, 0)).abs().max().item(),
        "input grad": (mine.grad - _chunk(x.grad, comm, 0)).abs().max().item(),
        "norm grad": (sp_norm.weight.grad - norm.weight.grad).abs().max().item(),
        "fc grad": (col.weight.grad - _chunk(fc.weight.grad, comm, 0)).abs().max().item(),
        "row bias grad": (row.bias.grad - proj.bias.grad).abs().max().item(),
    }


def test_sequence_parallel_block_needs_its_layernorm_gradients_summed():
    summed = run_distributed(_sequence_parallel_block, 2, True, timeout=120)
    for got in summed:
        assert max(got.values()) < 1e-4, got
    # Without the sum every rank's LayerNorm sees half the sequence: its gradient is wrong
    # (and differs between ranks) while everything else still matches, silently.
    unsummed = run_distributed(_sequence_parallel_block, 2, False, timeout=120)
    for got in unsummed:
        assert got["output"] < 1e-4, got
        assert got["norm grad"] > 1e-2, got


def _dropout_streams() -> dict:
    from zerotrain.parallel.tensor import TensorParallelRNG

    comm = Communicator()
    torch.manual_seed(1234)  # the job's seed, alike on every rank
    rng = TensorParallelRNG(comm, seed=1234)
    ones = torch.ones(64)
    shared_before = F.dropout(ones, 0.5)
    with rng.fork():
        split = F.dropout(ones, 0.5)
    shared_after = F.dropout(ones, 0.5)
    torch.manual_seed(1234)
    F.dropout(ones, 0.5)
    undisturbed = F.dropout(ones, 0.5)  # the shared stream with no fork in between
    return {
        "shared": torch.cat([shared_before, shared_after]).tolist(),
        "split": split.tolist(),
        "undisturbed": bool(torch.equal(undisturbed, shared_after)),
    }


def test_dropout_is_shared_outside_split_regions_and_per_rank_inside():
    first, second = run_distributed(_dropout_streams, 2, timeout=60)
    assert first["shared"] == second["shared"]  # replicas keep equal
    assert first["split"] != second["split"]  # independent masks for different slices
    assert first["undisturbed"]
    assert second["undisturbed"]

"""Memory and communication of tensor and Ulysses sequence parallelism, against closed forms.

A small GPT (``L`` pre-norm blocks of hidden size ``h``, a vocabulary of ``V``) is cut into
this rank's slices with ``from_dense`` on ``t`` = 2 and 4 gloo ranks, fp32 (4 bytes an
element); ``b`` is the batch and ``s`` the sequence. Every number below is an exact integer.

Memory, per rank. Column-parallel weights and biases (``qkv``, ``fc``, the head),
row-parallel weights (``proj``, ``out``) and the vocabulary-parallel embedding hold exactly
1/t of the dense bytes; LayerNorms and row-parallel biases stay whole. A block has
``12h^2 + 7h`` split elements and ``6h`` whole ones, so a rank holds
``4 * ((L(12h^2 + 7h) + 2Vh) / t + 6hL + 2h)`` bytes of parameters.

How ``comm.snapshot()`` counts (``comm/stats.py``): ``payload_bytes`` is the tensor the
collective is called with: for an all-reduce the tensor reduced in place, for a
reduce-scatter its whole input, for an all-gather its whole output, for an all-to-all this
rank's whole send buffer (its own part included). ``bytes`` is the ZeRO paper's volume
model: 2x the payload for an all-reduce (a reduce-scatter plus an all-gather), 1x for the
others. Neither depends on ``t``.

Tensor parallelism (Megatron's analysis). A block (attention ``qkv`` column -> ``proj`` row,
MLP ``fc`` column -> ``out`` row) all-reduces ``b*s*h`` elements twice forward (leaving each
region) and twice backward (the input gradient entering each region); the embedding adds one
forward; the column-parallel head enters its region like a block, so it adds one backward;
``vocab_parallel_cross_entropy`` adds three all-reduces of ``b*s`` forward (max, sum of
exponentials, target logit) and none backward. So a step all-reduces ``(2L + 1) b*s*h + 3 b*s``
elements forward and ``(2L + 1) b*s*h`` backward, and nothing else.

Megatron sequence parallelism (``sequence_dim=1``): each all-reduce of ``S = 4 b*s*h`` bytes
becomes a reduce-scatter (input ``S``) plus an all-gather (output ``S``). The volume model
counts 2S for the all-reduce and S + S for the pair: equal, as on the wire, where a ring
all-reduce of S sends ``2S(t-1)/t`` per rank and a reduce-scatter and an all-gather
``S(t-1)/t`` each. ``payload_bytes`` doubles (2 calls of S instead of 1): it is not a volume.
The LayerNorms and row biases, whole on every rank but fed a slice of the sequence, then
need their gradients summed: 6 all-reduces of ``h`` per block backward
(``sequence_parallel_gradients``) from ``parallelize``'s hooks, measured here without an
engine; the engine makes one per step instead
(``test_tensor_parallel_parity.py``).

Ulysses (``DistributedAttention``, degree P): q, k, v go in and the context comes back by 4
all-to-alls per layer, each of this rank's ``b*s*h/P`` elements. The stats count the whole
send buffer; with an even split one part of ``1/P`` of it stays on the rank, so
``(P-1)/P`` leaves it: ``4 b*s*h (P-1)/P^2`` elements per layer forward, the same received
(every rank is alike), and the same again backward (the inverse exchanges). One all-gather
of the ``P`` sequence lengths (int64, ``purpose="control"``) per layer comes with it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence import DistributedAttention
from zerotrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sum_gradients_over_group,
    vocab_parallel_cross_entropy,
)
from zerotrain.testing.dist import run_distributed

B, S, H, HEADS, V, L = 2, 8, 8, 4, 16, 2
HEAD_DIM = H // HEADS
F32 = 4  # bytes
BSH = B * S * H

Count = tuple[int, int, int]  # calls, bytes (volume model), payload_bytes


def _all_reduce(calls: int, numel: int) -> Count:
    """``calls`` all-reduces of ``numel`` fp32 elements each: twice the payload moved."""
    return calls, 2 * calls * numel * F32, calls * numel * F32


def _once(calls: int, numel: int) -> Count:
    """``calls`` reduce-scatters (input), all-gathers (output) or all-to-alls (send buffer)
    of ``numel`` fp32 elements each: the payload moved once."""
    return calls, calls * numel * F32, calls * numel * F32


def _counts(comm: Communicator) -> dict[str, Count]:
    """Everything counted since the last reset, as ``{"op/purpose": Count}``; then reset."""
    counts = {
        f"{op}/{purpose}": (c.calls, c.bytes, c.payload_bytes)
        for (op, purpose), c in comm.snapshot().counts.items()
    }
    comm.stats.reset()
    return counts


class Block(nn.Module):
    """A pre-norm GPT block. The head count follows from ``qkv``'s width (laid out head by
    head, ``[heads, 3, d]``, as Megatron's), so the same forward runs on the dense block and
    on one rank's heads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (-1, 3, HEAD_DIM)).transpose(1, 2)
        q, k, v = qkv.unbind(-2)  # [b, heads, s, d]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).flatten(2))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _dense() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _split_block(dense: nn.Module, comm: Communicator, sequence_dim: int | None) -> nn.Module:
    """This rank's slices of a dense block; the LayerNorms stay whole."""
    block = copy.deepcopy(dense)
    for name in ("qkv", "fc"):
        column = ColumnParallelLinear.from_dense(
            getattr(dense, name), comm, sequence_dim=sequence_dim
        )
        setattr(block, name, column)
    for name in ("proj", "out"):
        row = RowParallelLinear.from_dense(getattr(dense, name), comm, sequence_dim=sequence_dim)
        setattr(block, name, row)
    return block


def _tensor_parallel(dense: TinyGPT, comm: Communicator) -> TinyGPT:
    model = copy.deepcopy(dense)
    model.embed = VocabParallelEmbedding.from_dense(dense.embed, comm)  # type: ignore[assignment]
    model.head = ColumnParallelLinear.from_dense(dense.head, comm)  # type: ignore[assignment]
    model.blocks = nn.ModuleList(_split_block(b, comm, None) for b in dense.blocks)
    return model


def _is_split(name: str) -> bool:
    """Column-parallel weights and biases, row-parallel weights, vocabulary rows."""
    module, param = name.rsplit(".", 1)
    kind = module.rsplit(".", 1)[-1]
    return kind in ("embed", "head", "qkv", "fc") or (kind in ("proj", "out") and param == "weight")


def _storage_bytes(model: nn.Module) -> dict[str, int]:
    # The storage, not numel: a slice that were a view of the dense weight would hold it all.
    return {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}


def _parameter_bytes() -> dict[str, int]:
    return _storage_bytes(_tensor_parallel(_dense(), Communicator()))


@pytest.mark.parametrize("world", [2, 4])
def test_split_parameters_hold_one_tth_of_the_dense_bytes(world: int) -> None:
    dense = _storage_bytes(_dense())
    assert all(dense[n] % world == 0 for n in dense if _is_split(n))
    expected = {n: size // world if _is_split(n) else size for n, size in dense.items()}
    split_numel = L * (12 * H * H + 7 * H) + 2 * V * H
    whole_numel = L * 6 * H + 2 * H
    assert sum(dense.values()) == F32 * (split_numel + whole_numel)
    for rank, got in enumerate(run_distributed(_parameter_bytes, world, timeout=60)):
        assert got == expected, rank
        assert sum(got.values()) == F32 * (split_numel // world + whole_numel), rank


def _tensor_parallel_step() -> dict[str, Any]:
    comm = Communicator()
    dense = _dense()
    gen = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, V, (2, B, S), generator=gen)
    dense_loss = F.cross_entropy(dense(ids).flatten(0, 1), targets.flatten())
    model = _tensor_parallel(dense, comm)
    comm.stats.reset()
    phases = {}
    x = model.embed(ids)
    phases["embedding"] = _counts(comm)
    for i, block in enumerate(model.blocks):
        x = block(x)
        phases[f"block {i}"] = _counts(comm)
    logits = model.head(model.norm(x))  # [b, s, V/t]
    phases["head"] = _counts(comm)
    loss = vocab_parallel_cross_entropy(logits, targets, comm).mean()
    phases["cross entropy"] = _counts(comm)
    loss.backward()
    phases["backward"] = _counts(comm)
    # The counted collectives are those of a correct step.
    torch.testing.assert_close(loss, dense_loss, rtol=0, atol=1e-5)
    return phases


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_step_all_reduces_as_megatron_counts(world: int) -> None:
    for rank, got in enumerate(run_distributed(_tensor_parallel_step, world, timeout=60)):
        assert got["embedding"] == {"all_reduce/activations": _all_reduce(1, BSH)}, rank
        for i in range(L):
            assert got[f"block {i}"] == {"all_reduce/activations": _all_reduce(2, BSH)}, rank
        assert got["head"] == {}, rank  # its output stays split over the vocabulary
        assert got["cross entropy"] == {"all_reduce/activations": _all_reduce(3, B * S)}, rank
        # Each block's two region entries, and the head's.
        backward = {"all_reduce/activation_gradients": _all_reduce(2 * L + 1, BSH)}
        assert got["backward"] == backward, rank


def _run_blocks(blocks: list[nn.Module], x: torch.Tensor, comm: Communicator) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)  # as if an embedding were below
    comm.stats.reset()
    for block in blocks:
        x = block(x)
    forward = _counts(comm)
    x.pow(2).sum().backward()
    return {"out": x.detach(), "forward": forward, "backward": _counts(comm)}


def _sequence_parallel_blocks() -> dict[str, Any]:
    comm = Communicator()
    dense = _dense()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    tensor = [_split_block(b, comm, None) for b in dense.blocks]
    sequence = [_split_block(b, comm, 1) for b in dense.blocks]
    for block in sequence:  # the parameters whole on every rank see a slice of the sequence
        whole = [p for name, p in block.named_parameters() if not _is_split(name)]
        sum_gradients_over_group(whole, comm)
    tp = _run_blocks(tensor, x, comm)
    mine = x.chunk(comm.world_size, dim=1)[comm.rank]  # this rank's positions
    sp = _run_blocks(sequence, mine, comm)
    torch.testing.assert_close(sp["out"], tp["out"].chunk(comm.world_size, dim=1)[comm.rank])
    return {"tensor": tp, "sequence": sp}


def _activation_bytes(counts: dict[str, Count], purpose: str) -> int:
    return sum(c[1] for key, c in counts.items() if key.endswith("/" + purpose))


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallelism_trades_each_all_reduce_for_a_reduce_scatter_and_all_gather(
    world: int,
) -> None:
    for rank, got in enumerate(run_distributed(_sequence_parallel_blocks, world, timeout=60)):
        tp, sp = got["tensor"], got["sequence"]
        assert tp["forward"] == {"all_reduce/activations": _all_reduce(2 * L, BSH)}, rank
        assert tp["backward"] == {"all_reduce/activation_gradients": _all_reduce(2 * L, BSH)}, rank
        assert sp["forward"] == {
            "all_gather/activations": _once(2 * L, BSH),  # entering attention and the MLP
            "reduce_scatter/activations": _once(2 * L, BSH),  # leaving them
        }, rank
        assert sp["backward"] == {
            "reduce_scatter/activation_gradients": _once(2 * L, BSH),
            "all_gather/activation_gradients": _once(2 * L, BSH),
            # 2 LayerNorms (weight, bias) and 2 row biases per block, h elements each.
            "all_reduce/sequence_parallel_gradients": _all_reduce(6 * L, H),
        }, rank
        # Same volume each way: 2S per all-reduce = S per reduce-scatter + S per all-gather.
        for direction, purpose in (
            ("forward", "activations"),
            ("backward", "activation_gradients"),
        ):
            moved = _activation_bytes(sp[direction], purpose)
            assert moved == _activation_bytes(tp[direction], purpose) == 2 * 2 * L * BSH * F32


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention on ``[s, b, heads, d]`` tensors."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


class UlyssesLayer(nn.Module):
    """Attention on ``[s/P, b, h]``: local projections, ``DistributedAttention`` between."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.attention = DistributedAttention(_causal, comm, scatter_idx=2, gather_idx=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HEAD_DIM)).unbind(2)  # [s/P, b, heads, d]
        return x + self.proj(self.attention(q, k, v).flatten(2))


def _ulysses_layers() -> dict[str, dict[str, Count]]:
    comm = Communicator()
    torch.manual_seed(3)
    layers = [UlyssesLayer(comm) for _ in range(L)]
    x = torch.randn(S, B, H).chunk(comm.world_size, dim=0)[comm.rank].requires_grad_(True)
    comm.stats.reset()
    out = x
    for layer in layers:
        out = layer(out)
    forward = _counts(comm)
    out.pow(2).sum().backward()
    return {"forward": forward, "backward": _counts(comm)}


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_all_to_alls_move_4bsh_p_minus_1_over_p_squared_per_layer(world: int) -> None:
    per_rank = BSH // world  # elements of q (k, v, the context) a rank holds
    lengths = (L, L * world * 8, L * world * 8)  # one all-gather of P int64 lengths a layer
    for rank, got in enumerate(run_distributed(_ulysses_layers, world, timeout=60)):
        assert got["forward"] == {
            "all_to_all/activations": _once(4 * L, per_rank),
            "all_gather/control": lengths,
        }, rank
        backward = {"all_to_all/activation_gradients": _once(4 * L, per_rank)}
        assert got["backward"] == backward, rank
        for counts, purpose in (
            (got["forward"], "activations"),
            (got["backward"], "activation_gradients"),
        ):
            counted = counts[f"all_to_all/{purpose}"][1]  # whole send buffers, own part included
            leaving = counted * (world - 1) // world  # even split: 1/P stays on the rank
            assert leaving == L * 4 * BSH * (world - 1) // world**2 * F32, (rank, purpose)

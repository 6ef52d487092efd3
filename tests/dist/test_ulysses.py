"""Ulysses attention over a sequence split across ranks equals attention on one process.

Causal attention on ``[s, b, h, d]`` tensors; each of 2 or 4 ranks holds ``s / P`` positions
of every head. ``DistributedAttention`` gives each rank its positions of the output and
the gradients of its slices of q, k and v, equal to single-process attention's, with four
all-to-alls forward (q, k, v, and the context back), each of the rank's whole slice (of which
``(P-1)/P`` leaves the rank). Grouped-query attention (2 key/value heads for 4 query heads)
works at degree 2 (heads split) and 4 (key/value heads repeated to the degree). A
sequence of 11 positions, which 2 and 4 do not divide, is split unevenly and matches too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence import DistributedAttention
from zerotrain.testing.dist import run_distributed

S, B, H, D = 8, 2, 4, 8


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention on ``[s, b, h, d]`` tensors."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True
    )
    return out.permute(2, 0, 1, 3)


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(S, B, H, D, generator=gen) for _ in range(3)]


def _reference() -> dict:
    q, k, v = (t.requires_grad_(True) for t in _inputs())
    out = causal_attention(q, k, v)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "grads": [t.grad for t in (q, k, v)]}


def _ulysses() -> dict:
    comm = Communicator()
    mine = [
        t.chunk(comm.world_size, dim=0)[comm.rank].clone().requires_grad_(True) for t in _inputs()
    ]
    attention = DistributedAttention(causal_attention, comm, scatter_idx=2, gather_idx=0)
    comm.stats.reset()
    out = attention(*mine)
    sent = comm.snapshot().get(op="all_to_all", purpose="activations")
    out.pow(2).sum().backward()
    return {
        "out": out.detach(),
        "grads": [t.grad for t in mine],
        "sent": (sent.calls, sent.payload_bytes),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_equals_single_process_attention(world):
    reference = _reference()
    for rank, got in enumerate(run_distributed(_ulysses, world, timeout=120)):
        chunk = slice(rank * S // world, (rank + 1) * S // world)
        torch.testing.assert_close(got["out"], reference["out"][chunk], rtol=0, atol=1e-5)
        for mine, whole in zip(got["grads"], reference["grads"], strict=True):
            torch.testing.assert_close(mine, whole[chunk], rtol=0, atol=1e-5)
        # q, k, v in and the context out: 4 all-to-alls of this rank's b*s*h*d/P elements.
        assert got["sent"] == (4, 4 * B * S * H * D // world * 4), got["sent"]


def _heads_not_divisible() -> str:
    comm = Communicator()
    attention = DistributedAttention(causal_attention, comm)
    q = torch.randn(S // comm.world_size, B, 3, D)
    try:
        attention(q, q, q)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_heads_not_divisible_by_the_degree_are_named():
    message = run_distributed(_heads_not_divisible, 2, timeout=60)[0]
    assert "3 heads" in message, message
    assert "degree 2" in message, message


KV_HEADS = 2


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention on ``[s, b, h, d]`` tensors (fewer key/value heads)."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True
    )
    return out.permute(2, 0, 1, 3)


def _gqa_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(S, B, H, D, generator=gen)
    return [q, *(torch.randn(S, B, KV_HEADS, D, generator=gen) for _ in range(2))]


def _gqa_reference() -> dict:
    q, k, v = (t.requires_grad_(True) for t in _gqa_inputs())
    out = gqa_attention(q, k, v)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "grads": [t.grad for t in (q, k, v)]}


def _gqa_ulysses() -> dict:
    comm = Communicator()
    mine = [
        t.chunk(comm.world_size, dim=0)[comm.rank].clone().requires_grad_(True)
        for t in _gqa_inputs()
    ]
    out = DistributedAttention(gqa_attention, comm)(*mine)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "grads": [t.grad for t in mine]}


@pytest.mark.parametrize("world", [2, 4])  # 2 divides the 2 key/value heads; 4 repeats them
def test_grouped_query_attention_with_fewer_kv_heads_than_ranks(world):
    reference = _gqa_reference()
    for rank, got in enumerate(run_distributed(_gqa_ulysses, world, timeout=120)):
        chunk = slice(rank * S // world, (rank + 1) * S // world)
        torch.testing.assert_close(got["out"], reference["out"][chunk], rtol=0, atol=1e-5)
        for mine, whole in zip(got["grads"], reference["grads"], strict=True):
            torch.testing.assert_close(mine, whole[chunk], rtol=0, atol=1e-5)


ODD = 11  # positions in all, not a multiple of the degree


def _odd_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randn(ODD, B, H, D, generator=gen) for _ in range(3)]


def _odd_split(world: int) -> list[slice]:
    sizes = [ODD // world + (r < ODD % world) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [slice(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _odd_ulysses() -> dict:
    comm = Communicator()
    where = _odd_split(comm.world_size)[comm.rank]
    mine = [t[where].clone().requires_grad_(True) for t in _odd_inputs()]
    out = DistributedAttention(causal_attention, comm)(*mine)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "grads": [t.grad for t in mine]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_sequence_not_divisible_by_the_degree_is_split_unevenly(world):
    q, k, v = (t.requires_grad_(True) for t in _odd_inputs())
    whole = causal_attention(q, k, v)
    whole.pow(2).sum().backward()
    splits = _odd_split(world)
    for rank, got in enumerate(run_distributed(_odd_ulysses, world, timeout=120)):
        torch.testing.assert_close(got["out"], whole.detach()[splits[rank]], rtol=0, atol=1e-5)
        for mine, full in zip(got["grads"], (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(mine, full[splits[rank]], rtol=0, atol=1e-5)

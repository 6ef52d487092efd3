"""Ulysses attention over a sequence split across ranks equals attention on one process.

Causal attention on ``[s, b, h, d]`` tensors; each of 2 or 4 ranks holds a slice of the
positions of every head. ``DistributedAttention`` gives each rank its positions of the
output and the gradients of its slices of q, k and v, equal to single-process attention's.
The shapes cover what the split rules distinguish: heads that divide the degree (four
all-to-alls of the rank's whole slice), grouped-query attention with key/value heads split
(degree 2) or repeated to the degree (4), query heads that do not divide the degree (6 over
4: split 2, 2, 1, 1), with GQA on top (6 query / 3 key/value heads over 4), and a sequence of
11 positions, which 2 and 4 do not divide (split unevenly, no padding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence import DistributedAttention, balanced_sizes, split_heads
from zerotrain.testing.dist import run_distributed

B, D = 2, 8


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal (grouped-query) attention on ``[s, b, h, d]`` tensors."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True
    )
    return out.permute(2, 0, 1, 3)


def _inputs(length: int, q_heads: int, kv_heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(length * 100 + q_heads * 10 + kv_heads)
    q = torch.randn(length, B, q_heads, D, generator=gen)
    return [q, *(torch.randn(length, B, kv_heads, D, generator=gen) for _ in range(2))]


def _slices(length: int, world: int) -> list[slice]:
    sizes = balanced_sizes(length, world)
    starts = [sum(sizes[:r]) for r in range(world)]
    return [slice(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _ulysses(length: int, q_heads: int, kv_heads: int) -> dict:
    comm = Communicator()
    where = _slices(length, comm.world_size)[comm.rank]
    mine = [t[where].clone().requires_grad_(True) for t in _inputs(length, q_heads, kv_heads)]
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


CASES = {
    "heads divide": (8, 4, 4, [2, 4]),
    "gqa split or repeated to the degree": (8, 4, 2, [2, 4]),
    "uneven query heads": (8, 6, 6, [4]),
    "uneven query heads with gqa": (8, 6, 3, [4]),
    "sequence not divisible": (11, 4, 4, [2, 4]),
}


@pytest.mark.parametrize(
    ("length", "q_heads", "kv_heads", "world"),
    [(s, hq, hkv, w) for s, hq, hkv, worlds in CASES.values() for w in worlds],
    ids=[f"{name}-{w}" for name, (*_, worlds) in CASES.items() for w in worlds],
)
def test_ulysses_attention_equals_single_process_attention(length, q_heads, kv_heads, world):
    q, k, v = (t.requires_grad_(True) for t in _inputs(length, q_heads, kv_heads))
    whole = causal_attention(q, k, v)
    whole.pow(2).sum().backward()
    slices = _slices(length, world)
    results = run_distributed(_ulysses, world, length, q_heads, kv_heads, timeout=120)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["out"], whole.detach()[slices[rank]], rtol=0, atol=1e-5)
        for mine, full in zip(got["grads"], (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(mine, full[slices[rank]], rtol=0, atol=1e-5)
    if length % world == 0 and q_heads % world == 0 and kv_heads == q_heads:
        # q, k, v in and the context out: 4 all-to-alls of this rank's b*s*h*d/P elements.
        per_call = B * length * q_heads * D // world * 4
        assert all(got["sent"] == (4, 4 * per_call) for got in results), results[0]["sent"]


def test_head_split_rules():
    assert split_heads(8, 8, 4).query == [2] * 4
    even = split_heads(8, 4, 4)
    assert (even.query, even.key_value, even.kv_repeat, even.groups) == (
        [2] * 4,
        [1] * 4,
        1,
        [2] * 4,
    )
    repeated = split_heads(8, 2, 4)
    assert (repeated.key_value, repeated.kv_repeat, repeated.groups) == ([1] * 4, 2, [2] * 4)
    uneven = split_heads(6, 3, 4)
    assert (uneven.query, uneven.key_value, uneven.kv_repeat) == ([2, 2, 1, 1], [2, 2, 1, 1], 2)
    assert balanced_sizes(11, 4) == [3, 3, 3, 2]


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "words"),
    [(3, 3, ["3 attention heads", "degree 4", "<= 3"]), (6, 4, ["6 query heads", "4 key/value"])],
)
def test_head_counts_that_cannot_work_are_named(q_heads, kv_heads, words):
    with pytest.raises(ValueError) as err:
        split_heads(q_heads, kv_heads, 4, "blocks.0.attn")
    for word in ["blocks.0.attn", *words]:
        assert word in str(err.value), str(err.value)

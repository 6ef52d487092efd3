"""Ulysses sequence parallelism: attention over a sequence split across ranks.

Each rank of the sequence group holds a slice of the sequence for every head. Before
attention, one all-to-all per input turns that into the whole sequence for a slice of the
heads, so any local attention (causal, flash, with masks) runs unchanged on whole sequences;
one all-to-all afterwards turns the result back. Per rank and layer that moves
``4 x b*s*h*(P-1)/P^2`` elements each way (q, k, v and the output), independent of how
attention itself is computed.

``DistributedAttention`` keeps DeepSpeed's signature (``local_attention``, the group,
``scatter_idx=2`` for the heads, ``gather_idx=0`` for the sequence, inputs shaped
``[s/P, b, h, d]``), with a ``Communicator`` for the group.

Sequences that do not divide by the degree: each rank may hold a different number of
positions; they are exchanged as they are (the lengths are all-gathered first, one tiny
collective per call), so nothing is padded and nothing needs masking.

Grouped-query attention: when the key/value heads are fewer than the degree P, each is
repeated (``repeat_interleave``, so query head i still meets key/value head
``i // (h / h_kv)``) up to P heads before the exchange, so every rank gets the key/value
head its query heads use. The query heads must divide by P, and P by the key/value heads
(or the key/value heads by P); anything else is an error naming the counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.regions import all_to_all_along


class DistributedAttention(nn.Module):
    """Run ``local_attention`` on whole sequences with a slice of the heads.

    Args:
        local_attention: ``f(q, k, v, *args, **kwargs)`` on tensors laid out like the inputs
            but with the whole sequence along ``gather_idx`` and ``h / P`` heads along
            ``scatter_idx``.
        sequence_group: the ranks the sequence is split over.
        scatter_idx: the heads' dimension of the inputs.
        gather_idx: the sequence's dimension of the inputs.

    Raises (when called):
        ValueError: heads not divisible by the group size (a clear error naming both).
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_group: Communicator,
        scatter_idx: int = 2,
        gather_idx: int = 0,
    ) -> None:
        super().__init__()
        self.local_attention = local_attention
        self.comm = sequence_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        degree = self.comm.world_size
        heads = query.shape[self.scatter_idx]
        if heads % degree:
            raise ValueError(
                f"DistributedAttention: query has {heads} heads along dimension "
                f"{self.scatter_idx}, not divisible by the sequence-parallel degree {degree}"
            )
        key, value = (
            self._spread_kv(t, heads, name) for t, name in ((key, "key"), (value, "value"))
        )
        lengths = self._lengths(query.shape[self.gather_idx], query.device)
        q, k, v = (
            all_to_all_along(t, self.comm, self.scatter_idx, self.gather_idx, lengths)
            for t in (query, key, value)
        )
        context = self.local_attention(q, k, v, *args, **kwargs)
        return all_to_all_along(
            context, self.comm, self.gather_idx, self.scatter_idx, scatter_sizes=lengths
        )

    def _lengths(self, mine: int, device: torch.device) -> list[int]:
        """Every rank's number of positions (one tiny all-gather): a sequence that does not
        divide by the degree is split unevenly and exchanged as it is, so nothing is padded
        or masked."""
        local = torch.tensor([mine], dtype=torch.int64, device=device)
        every = torch.empty(self.comm.world_size, dtype=torch.int64, device=device)
        self.comm.all_gather_into(every, local, purpose="control")
        return [int(n) for n in every.tolist()]

    def _spread_kv(self, t: torch.Tensor, q_heads: int, name: str) -> torch.Tensor:
        """Key/value heads as the exchange needs them: as they are when the degree divides
        them, else each repeated so that there are as many as the degree."""
        degree, kv_heads = self.comm.world_size, t.shape[self.scatter_idx]
        if kv_heads % degree == 0:
            return t
        if degree % kv_heads or q_heads % kv_heads:
            raise ValueError(
                f"DistributedAttention: {name} has {kv_heads} heads and query {q_heads}; with "
                f"sequence-parallel degree {degree} the key/value heads must divide by the "
                "degree, or divide both the degree and the query heads (grouped-query "
                "attention, repeated to the degree)"
            )
        return t.repeat_interleave(degree // kv_heads, dim=self.scatter_idx)

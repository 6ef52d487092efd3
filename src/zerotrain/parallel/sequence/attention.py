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
positions (``balanced_sizes``: the first ranks one more); they are exchanged as they are
(every rank's length is needed: inside ``known_lengths``, which the engine enters around a
forward of a batch from ``engine.shard_sequence`` whose length divides by the degree, they
are known; elsewhere they are all-gathered, one tiny collective and a host sync per call),
so nothing is padded and nothing needs masking. DeepSpeed pads to a multiple of the degree
instead.

Heads (``split_heads``): query heads that divide by the degree P are split evenly; ones
that do not are split unevenly (the first ``h % P`` ranks one more), which DeepSpeed's
Ulysses refuses. Fewer query heads than ranks is an error (a rank would have no work).
Grouped-query attention: key/value heads that divide by P are split evenly with the query
heads; fewer than P (and dividing P) are each repeated up to P before the exchange
(``repeat_interleave``, so query head i still meets key/value head ``i // (h / h_kv)``);
in every other case (uneven query heads, or counts that share no split) they are repeated
to one per query head, which costs more traffic but is always right.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.regions import all_to_all_along


def balanced_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes that differ by at most one, larger ones first."""
    return [total // parts + (rank < total % parts) for rank in range(parts)]


@dataclass(frozen=True)
class HeadSplit:
    """How the heads of one attention call are spread over the sequence group.

    Attributes:
        query: query heads per rank.
        key_value: key/value heads per rank (after repeating).
        kv_repeat: each key/value head is repeated this many times before the exchange.
    """

    query: list[int]
    key_value: list[int]
    kv_repeat: int

    @property
    def groups(self) -> list[int]:
        """Query heads per key/value head on each rank (transformers'
        ``num_key_value_groups`` as each rank sees it)."""
        return [q // kv for q, kv in zip(self.query, self.key_value, strict=True)]


def split_heads(q_heads: int, kv_heads: int, degree: int, where: str = "") -> HeadSplit:
    """The head split for ``q_heads`` query and ``kv_heads`` key/value heads over ``degree``
    ranks (see the module docstring for the rules).

    Raises:
        ValueError: fewer query heads than ranks, or query heads not a multiple of the
            key/value heads; the message names ``where``.
    """
    at = f"{where}: " if where else ""
    if q_heads < degree:
        raise ValueError(
            f"{at}{q_heads} attention heads cannot be spread over the sequence-parallel degree "
            f"{degree}: every rank needs at least one head; use sequence_parallel_size <= "
            f"{q_heads}"
        )
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"{at}{q_heads} query heads are not a multiple of the {kv_heads} key/value heads"
        )
    if q_heads % degree == 0 and kv_heads % degree == 0:
        return HeadSplit([q_heads // degree] * degree, [kv_heads // degree] * degree, 1)
    if q_heads % degree == 0 and degree % kv_heads == 0:
        return HeadSplit([q_heads // degree] * degree, [1] * degree, degree // kv_heads)
    query = balanced_sizes(q_heads, degree)
    return HeadSplit(query, list(query), q_heads // kv_heads)


# (communicator, every rank's length) while a caller knows the sequence's global length.
_KNOWN: contextvars.ContextVar[tuple[Communicator, tuple[int, ...]] | None] = (
    contextvars.ContextVar("zerotrain_sequence_lengths", default=None)
)


@contextlib.contextmanager
def known_lengths(comm: Communicator, total: int) -> Iterator[None]:
    """Within the block, attention over ``comm`` whose slice has ``total / P`` positions
    takes every rank's length from that instead of all-gathering them in every call: no
    collective and no host sync per layer. Every rank of ``comm`` must enter it alike (the
    engine does, around a forward of a batch from ``shard_sequence``).

    Only for a ``total`` that divides by the degree: then every rank holds as many
    positions, so a layer that changes the length (prepended tokens, an encoder of another
    length) changes it alike on every rank, and every rank falls back to the all-gather
    alike. With uneven slices a rank-local check could let one rank skip the collective
    that another makes, so those keep the all-gather.

    Raises:
        ValueError: a ``total`` that does not divide by the degree.
    """
    if total % comm.world_size:
        raise ValueError(
            f"known_lengths needs a length that divides by the degree {comm.world_size}, "
            f"got {total}"
        )
    token = _KNOWN.set((comm, tuple(balanced_sizes(total, comm.world_size))))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def sequence_lengths(comm: Communicator, mine: int, device: torch.device) -> list[int]:
    """Every rank's number of positions, so that slices of different lengths are exchanged
    as they are: from ``known_lengths`` when inside it and this slice has the length it
    gives (the same on every rank), else one tiny all-gather."""
    known = _KNOWN.get()
    if known is not None and known[0] is comm and known[1][comm.rank] == mine:
        return list(known[1])
    local = torch.tensor([mine], dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather_into(every, local, purpose="control")
    return [int(n) for n in every.tolist()]


def to_heads(
    x: torch.Tensor,
    comm: Communicator,
    head_dim: int,
    seq_dim: int,
    heads: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """A slice of the sequence with every head -> the whole sequence with this rank's
    ``heads[rank]`` heads."""
    return all_to_all_along(x, comm, head_dim, seq_dim, gather_sizes=lengths, scatter_sizes=heads)


def to_sequence(
    x: torch.Tensor,
    comm: Communicator,
    head_dim: int,
    seq_dim: int,
    heads: list[int],
    lengths: list[int],
) -> torch.Tensor:
    """The inverse of :func:`to_heads`: the whole sequence with some heads -> this rank's
    ``lengths[rank]`` positions with every head."""
    return all_to_all_along(x, comm, seq_dim, head_dim, gather_sizes=heads, scatter_sizes=lengths)


def gather_heads(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Communicator,
    head_dim: int,
    seq_dim: int,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadSplit, list[int]]:
    """q, k and v of this rank's slice of the sequence -> the whole sequence with this
    rank's heads (key/value heads repeated as :func:`split_heads` says); also returns the
    split and every rank's length, which :func:`to_sequence` needs on the way back.

    Raises:
        ValueError: head counts that cannot be split (naming ``where``).
    """
    split = split_heads(query.shape[head_dim], key.shape[head_dim], comm.world_size, where)
    lengths = sequence_lengths(comm, query.shape[seq_dim], query.device)
    q = to_heads(query, comm, head_dim, seq_dim, split.query, lengths)
    k, v = (
        to_heads(
            t.repeat_interleave(split.kv_repeat, dim=head_dim),
            comm,
            head_dim,
            seq_dim,
            split.key_value,
            lengths,
        )
        for t in (key, value)
    )
    return q, k, v, split, lengths


class DistributedAttention(nn.Module):
    """Run ``local_attention`` on whole sequences with a slice of the heads.

    Args:
        local_attention: ``f(q, k, v, *args, **kwargs)`` on tensors laid out like the inputs
            but with the whole sequence along ``gather_idx`` and this rank's heads along
            ``scatter_idx`` (as many key/value heads as the split gives: see
            ``split_heads``); it returns the context in the same layout as ``q``.
        sequence_group: the ranks the sequence is split over.
        scatter_idx: the heads' dimension of the inputs.
        gather_idx: the sequence's dimension of the inputs.

    Raises (when called):
        ValueError: fewer query heads than ranks, or key and value with different head
            counts (naming the counts).
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
        heads_at, seq_at = self.scatter_idx, self.gather_idx
        if key.shape[heads_at] != value.shape[heads_at]:
            raise ValueError(
                f"DistributedAttention: key has {key.shape[heads_at]} heads and value "
                f"{value.shape[heads_at]} along dimension {heads_at}; they must be equal"
            )
        q, k, v, split, lengths = gather_heads(
            query, key, value, self.comm, heads_at, seq_at, "DistributedAttention"
        )
        context = self.local_attention(q, k, v, *args, **kwargs)
        return to_sequence(context, self.comm, heads_at, seq_at, split.query, lengths)

"""Collectives as autograd functions: the edges of tensor- and sequence-parallel regions.

A tensor-parallel block (Megatron's) enters its region with :func:`copy_to_group`
(identity forward; the input's gradient is summed over the group backward, because every
rank's shard of the next layer used the whole input) and leaves it with
:func:`reduce_from_group` (the partial outputs are summed forward; the gradient passes
through). With sequence parallelism the all-reduces become :func:`reduce_scatter_along` on
the way out (each rank keeps its slice of the sequence) and :func:`all_gather_along` on the
way in, whose backward passes are each other; Ulysses sequence parallelism swaps a
sequence split for a head split with :func:`all_to_all_along`. :func:`gather_along` /
:func:`scatter_along` move between a tensor split along a dimension and the whole tensor
(a column-parallel layer's output, a row-parallel layer's input).

Every function takes the group's :class:`Communicator`; on a group of one rank each is the
identity. Traffic is counted as ``activations`` forward and ``activation_gradients``
backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from zerotrain.comm.collectives import Communicator

FORWARD, BACKWARD = "activations", "activation_gradients"


def _all_reduce(x: torch.Tensor, comm: Communicator, purpose: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, purpose=purpose)
    return out


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int, purpose: str) -> torch.Tensor:
    shard = x.contiguous()
    stacked = torch.empty((comm.world_size, *shard.shape), dtype=shard.dtype, device=shard.device)
    comm.all_gather_into(stacked, shard, purpose=purpose)
    return torch.cat(stacked.unbind(0), dim=dim)


def _own_chunk(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % comm.world_size:
        raise ValueError(
            f"dimension {dim} of size {size} does not split evenly over the {comm.world_size} "
            "ranks of the group; pad it to a multiple"
        )
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int, purpose: str) -> torch.Tensor:
    _own_chunk(x, comm, dim)  # checks the split
    stacked = torch.stack(x.chunk(comm.world_size, dim=dim)).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, stacked, purpose=purpose)
    return out


def _exchange(
    x: torch.Tensor,
    comm: Communicator,
    scatter: tuple[int, Sequence[int]],
    gather: tuple[int, Sequence[int]],
    purpose: str,
) -> torch.Tensor:
    """Split ``x`` along dimension ``scatter[0]`` into parts of ``scatter[1]`` (one per
    rank, in rank order) and send part j to rank j; concatenate what the ranks send here
    along ``gather[0]``, where rank i's part has ``gather[1][i]`` entries (all other
    dimensions as in ``x``, the scattered one at this rank's size)."""
    n, me = comm.world_size, comm.rank
    scatter_dim, scatter_sizes = scatter[0] % x.dim(), list(scatter[1])
    gather_dim, gather_sizes = gather[0] % x.dim(), list(gather[1])
    if sum(scatter_sizes) != x.shape[scatter_dim] or len(scatter_sizes) != n:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of size {x.shape[scatter_dim]} cannot be "
            f"split into {scatter_sizes} over {n} ranks"
        )
    parts = x.split(scatter_sizes, dim=scatter_dim)
    send = torch.cat([p.reshape(-1) for p in parts])
    shapes = []
    for i in range(n):
        shape = list(parts[me].shape)
        shape[gather_dim] = gather_sizes[i]
        shapes.append(shape)
    counts = [math.prod(shape) for shape in shapes]
    recv = torch.empty(sum(counts), dtype=x.dtype, device=x.device)
    comm.all_to_all(
        recv,
        send,
        output_split_sizes=counts,
        input_split_sizes=[p.numel() for p in parts],
        purpose=purpose,
    )
    pieces = [r.view(shape) for r, shape in zip(recv.split(counts), shapes, strict=True)]
    return torch.cat(pieces, dim=gather_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Communicator,
        scatter: tuple[int, Sequence[int]],
        gather: tuple[int, Sequence[int]],
    ) -> torch.Tensor:
        ctx.comm, ctx.scatter, ctx.gather = comm, scatter, gather
        return _exchange(x, comm, scatter, gather, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The inverse exchange: what was gathered is scattered back by the same sizes.
        return _exchange(grad, ctx.comm, ctx.gather, ctx.scatter, BACKWARD), None, None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm, BACKWARD), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return _all_reduce(x, comm, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_chunk(grad, ctx.comm, ctx.dim), None, None


class _ScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _own_chunk(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.comm, ctx.dim, BACKWARD), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.comm, ctx.dim, BACKWARD), None, None


class _AllGatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim, FORWARD)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.comm, ctx.dim, BACKWARD), None, None


def copy_to_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Enter a tensor-parallel region: identity; backward sums the gradient over the group
    (Megatron's ``f``)."""
    return x if comm.world_size == 1 else _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the ranks' partial results; backward passes the
    gradient through (Megatron's ``g``)."""
    return x if comm.world_size == 1 else _ReduceFromGroup.apply(x, comm)


def gather_along(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' slices along ``dim``; backward keeps this rank's slice."""
    return x if comm.world_size == 1 else _GatherAlong.apply(x, comm, dim)


def scatter_along(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (even split); backward gathers."""
    return x if comm.world_size == 1 else _ScatterAlong.apply(x, comm, dim)


def reduce_scatter_along(x: torch.Tensor, comm: Communicator, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``dim`` (sequence parallelism's
    exit from a tensor-parallel region); backward all-gathers."""
    return x if comm.world_size == 1 else _ReduceScatterAlong.apply(x, comm, dim)


def all_to_all_along(
    x: torch.Tensor,
    comm: Communicator,
    scatter_dim: int,
    gather_dim: int,
    gather_sizes: Sequence[int] | None = None,
    scatter_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim``, send part j to rank j, and concatenate what every
    rank sent here along ``gather_dim`` in rank order (Ulysses' exchange: a slice of the
    sequence with every head becomes the whole sequence with a slice of the heads);
    backward runs the inverse exchange.

    Args:
        scatter_sizes: the parts' sizes along ``scatter_dim`` (default: even).
        gather_sizes: each rank's size along ``gather_dim`` (default: this rank's, on
            every rank), for slices of uneven length.
    """
    n = comm.world_size
    if n == 1:
        return x
    if scatter_sizes is None:
        _own_chunk(x, comm, scatter_dim)  # checks the split
        scatter_sizes = [x.shape[scatter_dim] // n] * n
    if gather_sizes is None:
        gather_sizes = [x.shape[gather_dim]] * n
    scatter = (scatter_dim, tuple(scatter_sizes))
    gather = (gather_dim, tuple(gather_sizes))
    result: torch.Tensor = _Exchange.apply(x, comm, scatter, gather)
    return result


def all_gather_along(x: torch.Tensor, comm: Communicator, dim: int = 0) -> torch.Tensor:
    """Concatenate the ranks' slices along ``dim`` (sequence parallelism's entry into a
    tensor-parallel region); backward reduce-scatters, since every rank's region used the
    whole tensor."""
    return x if comm.world_size == 1 else _AllGatherAlong.apply(x, comm, dim)

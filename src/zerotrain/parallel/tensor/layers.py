"""Megatron-style tensor-parallel layers: each rank holds a slice of one weight.

``ColumnParallelLinear`` splits the output features (rows of ``weight``) over the tensor
group: each rank computes its slice of the output from the whole input. ``RowParallelLinear``
splits the input features (columns of ``weight``): each rank multiplies its slice of the
input and the partial outputs are summed. A column layer followed by a row layer (an MLP,
attention's QKV and output projections) needs one sum forward and one backward: the input
enters the region with ``copy_to_group`` and leaves it with ``reduce_from_group``.
``VocabParallelEmbedding`` splits the vocabulary: each rank looks up the ids in its range
and the rows are summed (zeros elsewhere).

Every layer is built from the dense module it replaces (``from_dense``), so a model is made
tensor-parallel without rewriting it and its values equal the dense model's. Splits must be
even: a dimension not divisible by the group size is an error naming the layer. A packed
column layer (a fused ``[q; k; v]`` projection: ``parts``) takes its slice of each part, so
its output is again ``[q; k; v]``, of this rank's heads.

Each layer's ``splits`` says, per parameter, which blocks of the global tensor this rank
holds (``TensorSplit``): checkpoints address the parameters in global coordinates with it,
and parameters absent from it are whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.regions import (
    all_gather_along,
    copy_to_group,
    gather_along,
    reduce_from_group,
    reduce_scatter_along,
    scatter_along,
)
from zerotrain.parallel.tensor.splits import TensorSplit, even_split


def _split_size(size: int, comm: Communicator, what: str) -> int:
    if size % comm.world_size:
        raise ValueError(
            f"{what} = {size} does not split evenly over a tensor-parallel group of "
            f"{comm.world_size}; use a degree that divides it"
        )
    return size // comm.world_size


def _slice(tensor: torch.Tensor, split: TensorSplit) -> torch.Tensor:
    """This rank's blocks of the whole ``tensor``, concatenated (a copy)."""
    blocks = [tensor.detach().narrow(split.dim, o, n) for o, n in split.blocks]
    return torch.cat(blocks, dim=split.dim).clone()


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s output rows (and ``b``) split over the group.

    Args:
        in_features, out_features: of the whole layer.
        comm: the tensor-parallel group.
        bias: whether the layer has a bias (split like the output).
        gather_output: concatenate the ranks' output slices (else each rank keeps its own,
            the input a row-parallel layer expects).
        sequence_dim: Megatron sequence parallelism: the input is this rank's slice of the
            sequence along this dimension and is all-gathered here (instead of entering the
            region whole); None: the input is whole.
        parts: a packed projection's part sizes along the output (``(C, C, C)`` for a
            fused ``[q; k; v]``; they add up to ``out_features``): each is split on its
            own. Empty: one part.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        gather_output: bool = False,
        sequence_dim: int | None = None,
        parts: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.gather_output = comm, gather_output
        self.sequence_dim = sequence_dim
        if gather_output and parts:
            raise ValueError(
                "ColumnParallelLinear: a packed projection (parts) cannot gather its output: "
                "the gathered slices would interleave the parts"
            )
        for size in parts or (out_features,):
            _split_size(
                size, comm, "ColumnParallelLinear out_features" + (" part" if parts else "")
            )
        self.parts = tuple(parts)
        weight = even_split((out_features, in_features), 0, comm.rank, comm.world_size, parts)
        self.weight = nn.Parameter(torch.empty(weight.local_shape))
        self.bias = nn.Parameter(torch.zeros(weight.local_shape[0])) if bias else None
        self.splits = {"weight": weight}
        if bias:
            self.splits["bias"] = even_split((out_features,), 0, comm.rank, comm.world_size, parts)

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        comm: Communicator,
        gather_output: bool = False,
        sequence_dim: int | None = None,
        parts: tuple[int, ...] = (),
    ) -> ColumnParallelLinear:
        """This rank's slice of ``linear`` (same values)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            linear.bias is not None,
            gather_output,
            sequence_dim,
            parts,
        ).to(device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_slice(linear.weight, layer.splits["weight"]))
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(_slice(linear.bias, layer.splits["bias"]))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_dim is None:
            x = copy_to_group(x, self.comm)
        else:
            x = all_gather_along(x, self.comm, self.sequence_dim)
        y = F.linear(x, self.weight, self.bias)
        return gather_along(y, self.comm, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        packed = f", parts={list(self.parts)}" if self.parts else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {self.weight.shape[0]}){packed}, tensor_parallel={self.comm.world_size}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s input columns split over the group; ``b`` is whole
    and added once, after the partial outputs are summed.

    Args:
        in_features, out_features: of the whole layer.
        comm: the tensor-parallel group.
        bias: whether the layer has a bias.
        input_is_parallel: the input is already this rank's slice of the features (a
            column-parallel layer's output); else it is whole and sliced here.
        sequence_dim: Megatron sequence parallelism: the summed output is reduce-scattered
            along this dimension, each rank keeping its slice of the sequence; None: every
            rank gets the whole sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.sequence_dim = sequence_dim
        _split_size(in_features, comm, "RowParallelLinear in_features")
        weight = even_split((out_features, in_features), 1, comm.rank, comm.world_size)
        self.weight = nn.Parameter(torch.empty(weight.local_shape))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.splits = {"weight": weight}  # the bias is whole

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        comm: Communicator,
        input_is_parallel: bool = True,
        sequence_dim: int | None = None,
    ) -> RowParallelLinear:
        """This rank's slice of ``linear`` (same values)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            linear.bias is not None,
            input_is_parallel,
            sequence_dim,
        ).to(device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_slice(linear.weight, layer.splits["weight"]))
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_along(x, self.comm, -1)
        partial = F.linear(x, self.weight)
        if self.sequence_dim is None:
            y = reduce_from_group(partial, self.comm)
        else:
            y = reduce_scatter_along(partial, self.comm, self.sequence_dim)
        # The bias is whole on every rank: with sequence parallelism each rank's copy gets
        # the gradient of its slice only (see sum_gradients_over_group).
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
            f"out_features={self.out_features}, tensor_parallel={self.comm.world_size}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group: rank r holds ids
    ``[r * V/t, (r + 1) * V/t)``, looks up the ids in its range, writes zeros for the
    others, and the ranks' rows are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        local = _split_size(num_embeddings, comm, "VocabParallelEmbedding num_embeddings")
        self.start = comm.rank * local
        self.end = self.start + local
        weight = even_split((num_embeddings, embedding_dim), 0, comm.rank, comm.world_size)
        self.weight = nn.Parameter(torch.empty(weight.local_shape))
        self.splits = {"weight": weight}

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: Communicator) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (same values)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError(
                "VocabParallelEmbedding: padding_idx and max_norm are not supported (the "
                "embedding to split has them)"
            )
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm).to(
            device=embedding.weight.device, dtype=embedding.weight.dtype
        )
        with torch.no_grad():
            layer.weight.copy_(_slice(embedding.weight, layer.splits["weight"]))
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(rows, self.comm)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (this rank: ids {self.start}.."
            f"{self.end - 1}), tensor_parallel={self.comm.world_size}"
        )

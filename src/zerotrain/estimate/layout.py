"""What one rank of a (pipe x data x sequence x tensor) job holds, for the estimator.

A rank's model states are those of its own piece of the model, sharded by ZeRO over its
data x sequence group: so the estimate of a 3D layout is the plain ZeRO estimate of that
piece, built exactly as ``initialize`` builds it, on the meta device (no memory):

- **pipe**: the rank's stage of the pipeline layer list (``PipelineModule(..., stage_id=)``);
- **tensor**: the rank's slices, cut by the same plan ``initialize`` would use (the
  config's AutoTP preset or the model's ``_tp_plan``) with the same split code;
- **sequence**: nothing to cut (Ulysses ranks hold the whole piece); it widens the ZeRO
  group, and divides each rank's tokens (activations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.config.schema import TensorParallelConfig
from zerotrain.estimate.core import MemoryEstimate, estimate_memory
from zerotrain.parallel.pipeline.specs import LayerSpec
from zerotrain.parallel.tensor import model_tp_plan, parallelize
from zerotrain.parallel.tensor.autotp import resolve_plan
from zerotrain.parallel.topology import ZERO_AXES, Topology
from zerotrain.pipe import PipelineModule


@dataclass(frozen=True)
class GroupShape:
    """A tensor group as the split code reads it while cutting (its size and this rank's
    place); no collective ever runs on it: the pieces live on the meta device."""

    world_size: int
    rank: int


@dataclass(frozen=True)
class RankPiece:
    """One rank's part of the job: its piece of the model and its ZeRO group."""

    model: nn.Module
    zero_world: int
    zero_rank: int
    tensor: int
    sequence: int
    isolate: tuple[str, ...] = ()


def rank_piece(
    model: nn.Module | Sequence[LayerSpec],
    topology: Topology,
    rank: int,
    tp_preset: str | None = None,
) -> RankPiece:
    """Rank ``rank``'s piece of ``model`` under ``topology`` (built on the meta device).

    Args:
        model: a module, or a pipeline layer list (needed when ``topology.pipe > 1``).
        tp_preset: DeepSpeed AutoTP's ``preset_model`` (default: the model's ``_tp_plan``).

    Raises:
        ValueError: pipeline stages without a layer list, or no tensor-parallel plan.
    """
    where = topology.coordinates(rank)
    with torch.device("meta"):
        piece = _stage(model, topology.pipe, where.pipe)
    if topology.tensor > 1:
        if tp_preset is not None:
            section = TensorParallelConfig(autotp_size=topology.tensor, preset_model=tp_preset)
            plan, _ = resolve_plan(piece, section)
        else:
            plan = model_tp_plan(piece)
        group = cast(Communicator, GroupShape(topology.tensor, where.tensor))
        with torch.device("meta"):
            parallelize(piece, plan, group)
    zero_group = topology.group_ranks(ZERO_AXES, rank)
    return RankPiece(
        model=piece,
        zero_world=len(zero_group),
        zero_rank=zero_group.index(rank),
        tensor=topology.tensor,
        sequence=topology.sequence,
        isolate=tuple(piece.tied_prefixes()) if isinstance(piece, PipelineModule) else (),
    )


def _stage(model: nn.Module | Sequence[LayerSpec], stages: int, stage: int) -> nn.Module:
    if isinstance(model, nn.Module):
        if stages > 1:
            raise ValueError(
                f"--pp {stages}: give a factory returning the pipeline layer list (the "
                "LayerSpecs a PipelineModule is built from), so each stage can be built"
            )
        return model
    layers: list[Any] = list(model)
    return PipelineModule(layers, num_stages=stages, stage_id=stage)


def estimate_rank_memory(
    model: nn.Module | Sequence[LayerSpec],
    topology: Topology,
    rank: int = 0,
    tp_preset: str | None = None,
    **options: Any,
) -> MemoryEstimate:
    """``estimate_memory`` for rank ``rank`` of a job laid out as ``topology``: its piece
    of ``model`` (see :func:`rank_piece`), sharded over its ZeRO group. ``options`` are
    ``estimate_memory``'s other keywords (stage, dtype, offload, batch, ...).
    """
    piece = rank_piece(model, topology, rank, tp_preset)
    return estimate_memory(
        piece.model,
        world_size=piece.zero_world,
        rank=piece.zero_rank,
        tensor_parallel=piece.tensor,
        sequence_parallel=piece.sequence,
        isolate=piece.isolate,
        **options,
    )

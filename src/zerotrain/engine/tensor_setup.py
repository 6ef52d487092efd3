"""Tensor parallelism at ``initialize``: which plan, and splitting the model with it.

Every rank of a tensor group starts from the same dense model (rank 0's values and random
state), then keeps its own slices (``zerotrain.parallel.tensor.parallelize``). What the rest
of the engine needs to know afterwards: the parameters that stayed whole on every rank of
the group (LayerNorms, row biases, position embeddings), whose gradients the group's ranks
hold identically, so the global gradient norm counts them on one rank only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.config.optim_params import canonical_optimizer
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.parallel.groups import ProcessGroups
from zerotrain.parallel.tensor import (
    TensorParallelRNG,
    attach_rng,
    model_tp_plan,
    parallelize,
    tensor_splits,
)
from zerotrain.parallel.tensor.autotp import resolve_plan
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_BROADCAST_NUMEL = 50_000_000
# Optimizers whose update reads a per-parameter norm (trust ratios): under tensor
# parallelism a split parameter's norm would be its slice's.
_PER_PARAMETER_NORM = frozenset({"lamb", "onebitlamb"})


@dataclass(frozen=True)
class TensorParallelSetup:
    """What splitting the model produced.

    Attributes:
        plan: the plan applied (module glob -> style), and ``source``: where it came from.
        whole: parameters whole on every rank of the tensor group.
    """

    plan: dict[str, str]
    source: str
    whole: list[nn.Parameter]


def tensor_plan(cfg: ZeroTrainConfig, model: nn.Module, degree: int) -> tuple[dict[str, str], str]:
    """The plan that splits ``model`` ``degree`` ways: the config's, else the model's own.

    Raises:
        ValueError: none applies, or the config's optimizer cannot be split.
    """
    section = cfg.tensor_parallel
    if cfg.optimizer is not None and canonical_optimizer(cfg.optimizer.type) in _PER_PARAMETER_NORM:
        raise ValueError(
            f"optimizer.type={cfg.optimizer.type} with tensor parallelism: its trust ratios "
            "need each parameter's whole norm, and zerotrain does not sum them over the "
            "tensor group yet; use Adam/AdamW, or no tensor parallelism"
        )
    if section is None:
        if not getattr(model, "_tp_plan", None):
            raise ValueError(
                f"the topology has a tensor axis of {degree}, but {type(model).__name__} carries "
                "no tensor-parallel plan (_tp_plan) and the config has no tensor_parallel "
                "section: give tensor_parallel.plan, partition_config or preset_model"
            )
        return model_tp_plan(model), f"{type(model).__name__}._tp_plan"
    return resolve_plan(model, section)


# Attributes that hold an attention layer's head counts (the demo GPT's, transformers').
_HEAD_COUNTS = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")


def check_heads(model: nn.Module, degree: int) -> None:
    """Refuse, naming the module, a head count the degree does not divide: each rank must
    hold whole heads (zerotrain does not split heads unevenly).

    Raises:
        ValueError: a module (or a transformers model's config) with such a head count.
    """
    holders: list[tuple[str, object]] = list(model.named_modules())
    config = getattr(model, "config", None)
    if config is not None:
        holders.append(("config", config))
    for name, holder in holders:
        for attr in _HEAD_COUNTS:
            count = getattr(holder, attr, None)
            if isinstance(count, int) and not isinstance(count, bool) and count % degree:
                raise ValueError(
                    f"tensor parallelism of {degree}: '{name or type(model).__name__}' has "
                    f"{attr}={count}, which {degree} ranks cannot share as whole heads; use a "
                    f"degree that divides it (grouped-query attention: the key/value heads too)"
                )


def _same_random_state(groups: ProcessGroups, device: torch.device) -> None:
    """Give every rank of the tensor group rank 0's default generator: dropout outside the
    split regions must draw the same masks on all of them."""
    state = torch.get_rng_state()
    broadcast_tensors(groups.tensor, [state], _BROADCAST_NUMEL, src=0)
    torch.set_rng_state(state)
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device)
        broadcast_tensors(groups.tensor, [cuda_state], _BROADCAST_NUMEL, src=0)
        torch.cuda.set_rng_state(cuda_state, device)


def split_model(
    model: nn.Module,
    cfg: ZeroTrainConfig,
    groups: ProcessGroups,
    plan: dict[str, str],
    source: str,
    device: torch.device,
) -> TensorParallelSetup:
    """Make the tensor group's ranks start alike, then cut ``model`` with ``plan``."""
    tensor = groups.tensor
    check_heads(model, tensor.world_size)
    with torch.no_grad():
        state = [p.data for p in model.parameters()] + list(model.buffers())
        broadcast_tensors(tensor, state, _BROADCAST_NUMEL, src=0)
    _same_random_state(groups, device)
    seed = torch.tensor([torch.initial_seed() % (2**31)], dtype=torch.int64, device=device)
    broadcast_tensors(groups.world, [seed], _BROADCAST_NUMEL, src=0)
    sequence_parallel = cfg.tensor_parallel is not None and cfg.tensor_parallel.sequence_parallel
    applied = parallelize(model, plan, tensor, sequence_parallel=sequence_parallel)
    attach_rng(model, TensorParallelRNG(tensor, int(seed.item())))
    split = tensor_splits(model)
    whole = [p for n, p in model.named_parameters() if n not in split]
    log.info(
        "tensor parallel: %d-way over ranks %s, plan from %s%s: %d module(s) split, "
        "%d of %d parameters whole on every rank",
        tensor.world_size,
        groups.topology.group_ranks("tensor", groups.world.rank),
        source,
        " with Megatron sequence parallelism" if sequence_parallel else "",
        sum(1 for style in applied.values() if not style.startswith("sequence")),
        len(whole),
        len(list(model.parameters())),
    )
    return TensorParallelSetup(plan, source, whole)

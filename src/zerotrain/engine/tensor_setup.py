"""Tensor parallelism at ``initialize``: which plan, and splitting the model with it.

Every rank of a tensor group starts from the same dense model (``initialize`` broadcasts
rank 0's values; here its random state), then keeps its own slices
(``zerotrain.parallel.tensor.parallelize``). What the rest of the engine needs to know
afterwards: the parameters that stayed whole on every rank of
the group (LayerNorms, row biases, position embeddings), whose gradients the group's ranks
hold identically, so the global gradient norm counts them on one rank only.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.config.optim_params import canonical_optimizer
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.engine.sequence_setup import job_seed, sequence_seed_offset
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

_BROADCAST_NUMEL = 1 << 20  # random states and the seed: small tensors
# Optimizers whose update reads a per-parameter norm (trust ratios): under tensor
# parallelism a split parameter's norm would be its slice's.
_PER_PARAMETER_NORM = frozenset({"lamb", "onebitlamb"})


def tensor_plan(cfg: ZeroTrainConfig, model: nn.Module) -> tuple[dict[str, str], str]:
    """The plan that splits ``model``: the config's, else the model's own (the head counts
    are checked against the degree when the model is split).

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
    if section is None:  # a topology with a tensor axis: the model's own plan
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
) -> list[nn.Parameter]:
    """Give the tensor group's ranks one random state, then cut ``model`` (the same dense
    values on every rank of the group) with ``plan``. Returns the parameters left whole on
    every rank of the group."""
    tensor = groups.tensor
    check_heads(model, tensor.world_size)
    _same_random_state(groups, device)
    seed = job_seed(groups, device)
    sequence_parallel = cfg.tensor_parallel is not None and cfg.tensor_parallel.sequence_parallel
    applied = parallelize(model, plan, tensor, sequence_parallel=sequence_parallel)
    # Ulysses ranks hold other heads: their region streams differ too.
    attach_rng(model, TensorParallelRNG(tensor, seed + sequence_seed_offset(groups)))
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
    return whole

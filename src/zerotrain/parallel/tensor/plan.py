"""Make an existing model tensor-parallel from a plan, without rewriting it.

A plan maps module-name globs to how the module is split::

    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
     "embed_tokens": "vocab", "lm_head": "colwise_gather_output",
     "layers.*.attn.qkv": "packed_colwise:3"}

Each matching ``nn.Linear`` / ``nn.Embedding`` is replaced in place by this rank's slice
(``from_dense``, same values). The names are Hugging Face's ``_tp_plan`` styles, so a
``transformers`` model's own plan (:func:`model_tp_plan`) applies as it is; attention that
derives its head count from the projection's width (``view(..., -1, head_dim)``, as
``transformers`` models do) then runs on this rank's heads, grouped-query attention
included as long as the degree divides the key/value heads. A model that hard-codes its
head count needs it divided by the degree.

Heads and key/value heads must divide evenly: a projection whose width the degree does not
divide is an error naming the module (no uneven split). A fused projection is
``packed_colwise:N`` (N equal parts, ``[q; k; v]``: 3; Hugging Face's ``packed_colwise`` is
2, ``[gate; up]``) or ``packed_colwise:A,B,C`` (unequal parts, grouped-query ``[q; k; v]``):
each part is split on its own.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.regions import scatter_along
from zerotrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerotrain.parallel.tensor.sequence_parallel import sum_gradients_over_group
from zerotrain.parallel.tensor.splits import TensorSplit

# Style -> what it becomes. "sequence": a module whose parameters are whole on every rank
# but see a slice of the sequence (Megatron sequence parallelism: LayerNorm).
STYLES = {
    "colwise": "ColumnParallelLinear (output features split)",
    "colwise_gather_output": "ColumnParallelLinear gathering its output",
    "colwise_rep": "ColumnParallelLinear gathering its output (Hugging Face's older name)",
    "packed_colwise": "ColumnParallelLinear over packed parts: ':N' equal parts (default 2) "
    "or ':A,B,C' sizes",
    "rowwise": "RowParallelLinear (input features split; the input is a colwise output)",
    "rowwise_split_input": "RowParallelLinear taking a whole input",
    "vocab": "VocabParallelEmbedding (rows split)",
    "embedding_rowwise": "VocabParallelEmbedding (Hugging Face's name)",
    "sequence": "with sequence parallelism: parameters whole, each rank sees a slice of the "
    "sequence, gradients summed over the group (LayerNorm); nothing without it",
    "sequence_parallel": "Hugging Face's name of 'sequence'",
    "sequence_scatter": "with sequence parallelism: the module's output is cut along the "
    "sequence, each rank keeping its slice (where the split regions begin: after the "
    "embeddings); nothing without it",
}


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a ``transformers`` model carries (``model._tp_plan``, which
    ``transformers`` fills from ``config.base_model_tp_plan`` with the right prefixes).

    Raises:
        ValueError: the model has none.
    """
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} carries no tensor-parallel plan (_tp_plan); pass one: "
            '{"module.name.glob": "colwise" | "rowwise" | "vocab" | ...}'
        )
    return dict(plan)


def _parse_style(style: str, where: str) -> tuple[str, str]:
    """``"packed_colwise:3"`` -> ``("packed_colwise", "3")``; other styles have no argument."""
    base, _, argument = style.partition(":")
    if base not in STYLES or (argument and base != "packed_colwise"):
        allowed = "; ".join(f"{k}: {v}" for k, v in STYLES.items())
        raise ValueError(f"tensor-parallel plan: '{where}': unknown style {style!r} ({allowed})")
    return base, argument


def _packed_parts(argument: str, out_features: int, name: str) -> tuple[int, ...]:
    try:
        numbers = [int(v) for v in (argument or "2").split(",")]
    except ValueError:
        numbers = []
    if not numbers or any(n <= 0 for n in numbers):
        raise ValueError(
            f"tensor-parallel plan: '{name}': packed_colwise takes ':N' (N equal parts) or "
            f"':A,B,C' (part sizes), got {argument!r}"
        )
    if len(numbers) == 1:
        count = numbers[0]
        if out_features % count:
            raise ValueError(
                f"tensor-parallel plan: '{name}' has {out_features} output features, not "
                f"{count} equal packed parts"
            )
        return (out_features // count,) * count
    if sum(numbers) != out_features:
        raise ValueError(
            f"tensor-parallel plan: '{name}': packed parts {numbers} do not add up to its "
            f"{out_features} output features"
        )
    return tuple(numbers)


def _split(
    module: nn.Module, style: str, name: str, comm: Communicator, seq: int | None
) -> nn.Module:
    base, argument = _parse_style(style, name)
    want = nn.Embedding if base in ("vocab", "embedding_rowwise") else nn.Linear
    if type(module) is not want:
        raise TypeError(
            f"tensor-parallel plan: '{name}' is a {type(module).__name__}; style {style!r} "
            f"applies to {want.__name__}"
        )
    try:
        return _split_checked(module, base, argument, name, comm, seq)
    except ValueError as error:
        if str(error).startswith("tensor-parallel plan"):
            raise
        raise ValueError(f"tensor-parallel plan: '{name}' ({style}): {error}") from None


def _split_checked(
    module: nn.Module, style: str, argument: str, name: str, comm: Communicator, seq: int | None
) -> nn.Module:
    if style == "colwise":
        return ColumnParallelLinear.from_dense(module, comm, sequence_dim=seq)  # type: ignore[arg-type]
    if style == "packed_colwise":
        parts = _packed_parts(argument, module.out_features, name)  # type: ignore[arg-type]
        return ColumnParallelLinear.from_dense(module, comm, sequence_dim=seq, parts=parts)  # type: ignore[arg-type]
    if style in ("colwise_gather_output", "colwise_rep"):
        return ColumnParallelLinear.from_dense(module, comm, gather_output=True, sequence_dim=seq)  # type: ignore[arg-type]
    if style == "rowwise":
        row = RowParallelLinear.from_dense(module, comm, sequence_dim=seq)  # type: ignore[arg-type]
        if seq is not None and row.bias is not None:
            # Whole on every rank, added to this rank's slice of the sequence only.
            sum_gradients_over_group([row.bias], comm)
        return row
    if style == "rowwise_split_input":
        if seq is not None:
            raise ValueError(
                f"tensor-parallel plan: '{name}': rowwise_split_input takes a whole input, "
                "which sequence parallelism does not have; use colwise before rowwise"
            )
        return RowParallelLinear.from_dense(module, comm, input_is_parallel=False)  # type: ignore[arg-type]
    return VocabParallelEmbedding.from_dense(module, comm)  # type: ignore[arg-type]


def parallelize(
    model: nn.Module,
    plan: Mapping[str, str],
    comm: Communicator,
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
) -> dict[str, str]:
    """Apply ``plan`` to ``model`` in place over the tensor group ``comm``.

    With ``sequence_parallel`` (Megatron's), the regions between split layers hold a slice
    of the sequence (dimension ``sequence_dim`` of the activations): column layers
    all-gather their input, row layers reduce-scatter their output, the ``sequence`` styles
    act (gradient sums of whole parameters, the cut after the embeddings), and row biases
    get their gradients summed. The model must not reshape across the sequence between the
    split regions.

    Returns:
        The style applied to each module, by name.

    Raises:
        ValueError: an unknown style, or a glob that matches no module (a typo would
            otherwise leave the model silently replicated).
        TypeError: a style applied to a module it does not fit.
    """
    for glob, style in plan.items():
        _parse_style(style, glob)
    names = [name for name, _ in model.named_modules() if name]
    applied: dict[str, str] = {}
    for glob, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not matched:
            raise ValueError(f"tensor-parallel plan: '{glob}' matches no module of the model")
        for name in matched:
            applied[name] = style
    shared = _shared_weights(model)
    seq = sequence_dim if sequence_parallel and comm.world_size > 1 else None
    for name, style in applied.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if style in ("sequence", "sequence_parallel"):
            if seq is not None:
                sum_gradients_over_group(module.parameters(), comm)
        elif style == "sequence_scatter":
            if seq is not None:
                module.register_forward_hook(_scatter_output(comm, seq))
        elif comm.world_size > 1:
            setattr(parent, child, _split(module, style, name, comm, seq))
    if comm.world_size > 1:
        _retie(model, shared)
    return applied


def _scatter_output(comm: Communicator, dim: int) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return scatter_along(output, comm, dim)

    return hook


def _shared_weights(model: nn.Module) -> list[list[str]]:
    """Names of the modules sharing one ``weight`` (a tied output head), per weight."""
    by_weight: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            by_weight.setdefault(id(weight), []).append(name)
    return [names for names in by_weight.values() if len(names) > 1]


def _retie(model: nn.Module, shared: list[list[str]]) -> None:
    """Modules that shared a weight before the split share the first one's slice after it
    (a head tied to the token embedding: both cut along the vocabulary, the same rows)."""
    for names in shared:
        modules = [model.get_submodule(n) for n in names]
        splits = [getattr(m, "splits", {}).get("weight") for m in modules]
        if all(s is None for s in splits):
            continue
        if any(s != splits[0] for s in splits):
            described = ", ".join(
                f"'{n}' ({'whole' if s is None else f'split along dim {s.dim}'})"
                for n, s in zip(names, splits, strict=True)
            )
            raise ValueError(
                f"tensor-parallel plan: modules sharing one weight are split differently: "
                f"{described}; a tied head and embedding must both be split along the "
                "vocabulary ('vocab' and 'colwise')"
            )
        first = modules[0].weight
        for module in modules[1:]:
            module.weight = first


def tensor_splits(model: nn.Module) -> dict[str, TensorSplit]:
    """The split of every tensor-parallel parameter of ``model``, by parameter name
    (parameters absent are whole on every rank of the tensor group)."""
    found: dict[str, TensorSplit] = {}
    by_id: dict[int, TensorSplit] = {}
    for module in model.modules():
        for param_name, split in getattr(module, "splits", {}).items():
            param = getattr(module, param_name, None)
            if isinstance(param, torch.Tensor) and isinstance(split, TensorSplit):
                by_id[id(param)] = split
    for name, param in model.named_parameters():
        if id(param) in by_id:
            found[name] = by_id[id(param)]
    return found

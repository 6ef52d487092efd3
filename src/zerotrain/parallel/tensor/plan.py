"""Make an existing model tensor-parallel from a plan, without rewriting it.

A plan maps module-name globs to how the module is split::

    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
     "embed_tokens": "vocab", "lm_head": "colwise_gather_output"}

Each matching ``nn.Linear`` / ``nn.Embedding`` is replaced in place by this rank's slice
(``from_dense``, same values). The names are Hugging Face's ``_tp_plan`` styles, so a
``transformers`` model's own plan (:func:`model_tp_plan`) applies as it is; attention that
derives its head count from the projection's width (``view(..., -1, head_dim)``, as
``transformers`` models do) then runs on this rank's heads, grouped-query attention
included as long as the degree divides the key/value heads. A model that hard-codes its
head count needs it divided by the degree.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerotrain.parallel.tensor.sequence_parallel import sum_gradients_over_group

# Style -> what it becomes. "sequence": a module whose parameters are whole on every rank
# but see a slice of the sequence (Megatron sequence parallelism: LayerNorm).
STYLES = {
    "colwise": "ColumnParallelLinear (output features split)",
    "colwise_gather_output": "ColumnParallelLinear gathering its output",
    "rowwise": "RowParallelLinear (input features split; the input is a colwise output)",
    "rowwise_split_input": "RowParallelLinear taking a whole input",
    "vocab": "VocabParallelEmbedding (rows split)",
    "embedding_rowwise": "VocabParallelEmbedding (Hugging Face's name)",
    "sequence": "gradients summed over the group (parameters whole, sequence split)",
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


def _split(module: nn.Module, style: str, name: str, comm: Communicator) -> nn.Module:
    want = nn.Embedding if style in ("vocab", "embedding_rowwise") else nn.Linear
    if style != "sequence" and type(module) is not want:
        raise TypeError(
            f"tensor-parallel plan: '{name}' is a {type(module).__name__}; style {style!r} "
            f"applies to {want.__name__}"
        )
    if style == "colwise":
        return ColumnParallelLinear.from_dense(module, comm)  # type: ignore[arg-type]
    if style == "colwise_gather_output":
        return ColumnParallelLinear.from_dense(module, comm, gather_output=True)  # type: ignore[arg-type]
    if style == "rowwise":
        return RowParallelLinear.from_dense(module, comm)  # type: ignore[arg-type]
    if style == "rowwise_split_input":
        return RowParallelLinear.from_dense(module, comm, input_is_parallel=False)  # type: ignore[arg-type]
    return VocabParallelEmbedding.from_dense(module, comm)  # type: ignore[arg-type]


def parallelize(model: nn.Module, plan: Mapping[str, str], comm: Communicator) -> dict[str, str]:
    """Apply ``plan`` to ``model`` in place over the tensor group ``comm``.

    Returns:
        The style applied to each module, by name.

    Raises:
        ValueError: an unknown style, or a glob that matches no module (a typo would
            otherwise leave the model silently replicated).
        TypeError: a style applied to a module it does not fit.
    """
    for glob, style in plan.items():
        if style not in STYLES:
            allowed = "; ".join(f"{k}: {v}" for k, v in STYLES.items())
            raise ValueError(f"tensor-parallel plan: '{glob}': unknown style {style!r} ({allowed})")
    names = [name for name, _ in model.named_modules() if name]
    applied: dict[str, str] = {}
    for glob, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not matched:
            raise ValueError(f"tensor-parallel plan: '{glob}' matches no module of the model")
        for name in matched:
            applied[name] = style
    for name, style in applied.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        if style == "sequence":
            sum_gradients_over_group(module.parameters(), comm)
        elif comm.world_size > 1:
            setattr(parent, child, _split(module, style, name, comm))
    return applied

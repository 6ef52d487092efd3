"""Which plan splits a model: from the config, DeepSpeed's AutoTP specs, or the model.

In order, the first that applies:

1. ``tensor_parallel.plan``: ``{module-name glob: style}`` (zerotrain's own, the styles of
   :mod:`zerotrain.parallel.tensor.plan`).
2. DeepSpeed AutoTP's ``partition_config.layer_specs`` (regular expressions over parameter
   names, ``partition_type`` column / row / skip, ``shape`` for packed projections), merged
   with ``preset_model``'s specs when ``use_default_specs`` (custom specs match first); or
   ``preset_model`` alone.
3. The model's own ``_tp_plan`` (``transformers`` models fill it from
   ``config.base_model_tp_plan``; zerotrain's demo GPT carries one too).

Where we differ from DeepSpeed on purpose: DeepSpeed guesses a plan for any model from the
Linear layers it finds (and its guesses can leave a model silently replicated or wrongly
split); zerotrain needs one of the three above and says so when there is none. DeepSpeed's
AutoTP leaves embeddings and the output head whole; so do its specs here, while a model's
own plan may split them (vocabulary-parallel).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from zerotrain.parallel.tensor.plan import model_tp_plan

# DeepSpeed's preset layouts, as (patterns, partition type) over parameter names.
_LLAMA = [
    ([r".*\.self_attn\.o_proj\.weight$"], "row"),
    ([r".*\.self_attn\.[qkv]_proj\.weight$"], "column"),
    ([r".*\.mlp\.down_proj\.weight$"], "row"),
    ([r".*\.mlp\.(up|gate)_proj\.weight$"], "column"),
]
PRESETS: dict[str, list[tuple[list[str], str]]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    # zerotrain's demo GPT (zerotrain.examples.gpt): fused [q; k; v] in attn.qkv.
    "gpt": [
        ([r".*\.attn\.proj\.weight$", r".*\.mlp\.proj\.weight$"], "row"),
        ([r".*\.mlp\.fc\.weight$"], "column"),
        ([r".*\.attn\.qkv\.weight$"], "column:3"),
    ],
}


def _spec_style(spec: Any, name: str, out_features: int) -> str | None:
    """Our plan style for a DeepSpeed layer spec matching ``name``'s weight."""
    kind = spec["partition_type"]
    if kind == "skip":
        return None
    dim = spec.get("partition_dim")
    if dim is not None and dim != (0 if kind == "column" else 1):
        raise ValueError(
            f"tensor_parallel.partition_config: '{name}': partition_dim {dim} for a {kind} "
            "split is not supported (column splits dimension 0, row splits dimension 1)"
        )
    shape = spec.get("shape")
    if kind == "row":
        if shape is not None:
            raise ValueError(
                f"tensor_parallel.partition_config: '{name}': a shape (packed parts) is "
                "supported for column splits only"
            )
        return "rowwise"
    if shape is None:
        return "colwise_gather_output" if spec.get("gather_output") else "colwise"
    parts = shape[0] if isinstance(shape, (list, tuple)) and shape else None
    if isinstance(parts, int) and parts > 0:
        return f"packed_colwise:{parts}"
    if isinstance(parts, (list, tuple)) and all(isinstance(v, int) for v in parts):
        return "packed_colwise:" + ",".join(str(v) for v in parts)
    raise ValueError(
        f"tensor_parallel.partition_config: '{name}': shape {shape} is not supported; "
        "give [N, -1] (N equal packed parts) or [[A, B, C], -1] (part sizes) for a column "
        f"split of the {out_features} output features"
    )


def _specs(section: Any) -> list[dict[str, Any]]:
    preset = section.preset_model
    specs: list[dict[str, Any]] = []
    partition = section.partition_config
    if partition is not None:
        specs += [s.model_dump() for s in partition.layer_specs]
    if preset is not None and (partition is None or partition.use_default_specs):
        key = preset.lower()
        if key not in PRESETS:
            raise ValueError(
                f"tensor_parallel.preset_model={preset!r} is not a known layout; "
                f"available: {', '.join(sorted(PRESETS))} (or give partition_config.layer_specs)"
            )
        for patterns, kind in PRESETS[key]:
            kind, _, parts = kind.partition(":")
            shape = [int(parts), -1] if parts else None
            specs.append({"patterns": patterns, "partition_type": kind, "shape": shape})
    return specs


def plan_from_specs(
    model: nn.Module, specs: Sequence[dict[str, Any]], strict: bool, model_type: str | None
) -> dict[str, str]:
    """Module name -> style for every Linear whose weight's name a spec matches (the first
    matching spec wins, as in DeepSpeed)."""
    plan: dict[str, str] = {}
    unmatched = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = f"{name}.weight"
        spec = next(
            (
                s
                for s in specs
                if (not s.get("model_types") or (model_type or "") in s["model_types"])
                and any(re.match(p, weight) for p in s["patterns"])
            ),
            None,
        )
        if spec is None:
            unmatched.append(name)
            continue
        style = _spec_style(spec, name, module.out_features)
        if style is not None:
            plan[name] = style
    if strict and unmatched:
        raise ValueError(
            "tensor_parallel.partition_config.strict_mode: these Linear layers match no "
            f"layer spec: {', '.join(unmatched[:10])}" + (" ..." if len(unmatched) > 10 else "")
        )
    return plan


def resolve_plan(model: nn.Module, section: Any) -> tuple[dict[str, str], str]:
    """The plan that splits ``model`` under the config's ``tensor_parallel`` section, and
    where it came from (for the log).

    Raises:
        ValueError: nothing gives a plan, a preset is unknown, or specs match no layer.
    """
    if section.plan is not None:
        return dict(section.plan), "tensor_parallel.plan"
    specs = _specs(section)
    if specs:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        strict = section.partition_config is not None and section.partition_config.strict_mode
        plan = plan_from_specs(model, specs, strict, model_type)
        if not plan:
            raise ValueError(
                "tensor_parallel: the layer specs (partition_config / preset_model) match no "
                f"Linear layer of {type(model).__name__}; the patterns are regular "
                "expressions over parameter names such as 'layers.0.mlp.fc.weight'"
            )
        return plan, "tensor_parallel layer specs"
    if getattr(model, "_tp_plan", None):
        return model_tp_plan(model), f"{type(model).__name__}._tp_plan"
    raise ValueError(
        f"tensor_parallel.autotp_size={section.autotp_size}: no plan says how to split "
        f"{type(model).__name__}. Give tensor_parallel.plan ({{module glob: style}}), "
        "tensor_parallel.partition_config.layer_specs or tensor_parallel.preset_model "
        f"({', '.join(sorted(PRESETS))}), or use a model that carries its own _tp_plan "
        "(transformers models do). zerotrain does not guess a plan from the Linear layers."
    )

"""Legacy DeepSpeed spellings that are still honoured, rewritten to their current names.

Each rewrite is logged, and giving both the old and the new spelling is an error (which one
should win is not obvious).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from zerotrain.config.errors import ConfigProblem

# (path of the containing object, old key) -> new key
_RENAMES: Mapping[tuple[tuple[str, ...], str], str] = MappingProxyType(
    {
        ((), "bfloat16"): "bf16",
        (("zero_optimization",), "stage3_gather_fp16_weights_on_model_save"): (
            "stage3_gather_16bit_weights_on_model_save"
        ),
        (("zero_optimization",), "gather_16bit_weights_on_model_save"): (
            "stage3_gather_16bit_weights_on_model_save"
        ),
        # DeepSpeed's ZeRO model takes its stage-3 keys without the prefix too (populate by
        # field name); zerotrain keeps the prefixed spelling configs are written with.
        **{
            (("zero_optimization",), name): f"stage3_{name}"
            for name in (
                "prefetch_bucket_size",
                "param_persistence_threshold",
                "model_persistence_threshold",
                "max_live_parameters",
                "max_reuse_distance",
                "module_granularity_threshold",
                "use_all_reduce_for_fetch_params",
                "allgather_sequential",
            )
        },
        # DeepSpeed's TPTrainingConfig: field names next to their aliases.
        (("tensor_parallel",), "tensor_parallel"): "tp",
        (("tensor_parallel",), "kernel_inject"): "replace_with_kernel_inject",
    }
)
# Every spelling renamed above, as dotted paths (the key table lists them).
RENAMED_PATHS: Mapping[str, str] = MappingProxyType(
    {".".join((*path, old)): ".".join((*path, new)) for (path, old), new in _RENAMES.items()}
)


def _rename(
    container: dict[str, Any], path: tuple[str, ...], old: str, new: str, notes: list[str]
) -> ConfigProblem | None:
    if old not in container:
        return None
    where = ".".join((*path, old))
    if new in container:
        del container[old]  # reported here, so it is not reported again as unknown
        return ConfigProblem(where, f"legacy spelling of '{new}', which is also given; keep one")
    container[new] = container.pop(old)
    notes.append(f"{where} is the legacy spelling of {'.'.join((*path, new))}")
    return None


def _cpu_offload_flags(zero: dict[str, Any], notes: list[str]) -> list[ConfigProblem]:
    """``cpu_offload`` / ``cpu_offload_param(s)`` / ``cpu_offload_use_pin_memory`` (pre-0.3.16)."""
    problems: list[ConfigProblem] = []
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    # DeepSpeed 0.19 spells the parameter flag cpu_offload_param; older docs, with an s.
    flags = (
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
        ("cpu_offload_params", "offload_param"),
    )
    for old, new in flags:
        if old not in zero:
            continue
        flag = zero.pop(old)
        where = f"zero_optimization.{old}"
        if not isinstance(flag, bool):
            problems.append(ConfigProblem(where, f"got {flag!r}; allowed: true or false"))
            continue
        if new in zero:
            problems.append(ConfigProblem(where, f"legacy form of '{new}', which is also given"))
            continue
        if flag:
            zero[new] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
        notes.append(f"{where}={str(flag).lower()} is the legacy form of zero_optimization.{new}")
    return problems


def apply_legacy_spellings(raw: dict[str, Any]) -> tuple[list[ConfigProblem], list[str]]:
    """Rewrite legacy keys in ``raw`` in place. Returns (problems, notes for the log)."""
    problems: list[ConfigProblem] = []
    notes: list[str] = []
    for (path, old), new in _RENAMES.items():
        container: Any = raw
        for part in path:
            container = container.get(part) if isinstance(container, dict) else None
        if isinstance(container, dict):
            problem = _rename(container, path, old, new, notes)
            if problem:
                problems.append(problem)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        problems += _cpu_offload_flags(zero, notes)
    return problems, notes

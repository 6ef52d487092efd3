"""Resolution of ``"auto"`` values (placeholders the Hugging Face integration fills in).

``"auto"`` is accepted where its meaning is obvious:

* batch sizes: derived from the other batch keys and the world size;
* ``scheduler.params.warmup_max_lr``: the optimizer's learning rate;
* any other key that has a default: the default (logged, so the choice is visible);
* except keys where ``"auto"`` is a value of its own (``activation_checkpointing.block_types``:
  the repeated blocks; ``pipeline.stages``: the PipelineModule's), left as they are.

Where nothing can be inferred (the learning rate, step counts, the clipping threshold) the
loader says that the value must be filled in, instead of training with a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from zerotrain.config.errors import ConfigProblem

AUTO = "auto"

_DERIVED = {
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
}
_MUST_FILL: Mapping[tuple[str, ...], str] = MappingProxyType(
    {
        ("optimizer", "params", "lr"): "the learning rate",
        ("scheduler", "params", "total_num_steps"): "the total number of optimizer steps",
        ("scheduler", "params", "warmup_num_steps"): "the number of warm-up steps",
        ("gradient_clipping",): "the clipping threshold (0 disables clipping)",
        ("zero_optimization", "stage"): "the ZeRO stage",
    }
)
_MAX_LR = ("scheduler", "params", "warmup_max_lr")
_AUTO_IS_A_VALUE = {("activation_checkpointing", "block_types"), ("pipeline", "stages")}


@dataclass(frozen=True, slots=True)
class AutoResolution:
    """How one ``"auto"`` was resolved: removed so that a default or derivation applies."""

    path: tuple[str, ...]
    how: Literal["derived", "default", "optimizer_lr"]


def _walk(node: dict[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for key, value in node.items():
        if isinstance(value, dict):
            found += _walk(value, (*path, key))
        elif isinstance(value, str) and value.strip().lower() == AUTO:
            found.append((*path, key))
    return found


def _pop(raw: dict[str, Any], path: tuple[str, ...]) -> None:
    node = raw
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


def resolve_auto(raw: dict[str, Any]) -> tuple[list[AutoResolution], list[ConfigProblem]]:
    """Rewrite ``"auto"`` values in ``raw`` in place; return what was done and what cannot be."""
    resolutions: list[AutoResolution] = []
    problems: list[ConfigProblem] = []
    for path in _walk(raw, ()):
        if path in _AUTO_IS_A_VALUE:
            continue
        dotted = ".".join(path)
        if path in _MUST_FILL:
            _pop(raw, path)  # reported here; later stages must not report it again
            problems.append(
                ConfigProblem(
                    dotted,
                    f'is "auto", but zerotrain cannot infer {_MUST_FILL[path]} (the Hugging Face '
                    "Trainer fills it from its own arguments); give a value",
                )
            )
        elif path == _MAX_LR:
            lr = raw.get("optimizer", {}).get("params", {}).get("lr")
            if isinstance(lr, int | float) and not isinstance(lr, bool):
                raw["scheduler"]["params"]["warmup_max_lr"] = lr
                resolutions.append(AutoResolution(path, "optimizer_lr"))
            else:
                _pop(raw, path)
                problems.append(
                    ConfigProblem(
                        dotted,
                        'is "auto", which means the optimizer\'s lr, but optimizer.params.lr '
                        "is not a number; give a value",
                    )
                )
        else:
            _pop(raw, path)
            resolutions.append(AutoResolution(path, "derived" if path in _DERIVED else "default"))
    return resolutions, problems

"""``load_config``: raw JSON/dict -> a validated, immutable :class:`ZeroTrainConfig`.

Order of work: read the source, rewrite legacy spellings, resolve ``"auto"``, find unknown
keys (with did-you-mean), validate types and ranges, then validate ``optimizer.params`` and
``scheduler.params`` against their type. Every problem from every stage is collected and
raised once, in a single :class:`ConfigError`.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from zerotrain.config import optim_params
from zerotrain.config.auto import AutoResolution, resolve_auto
from zerotrain.config.errors import (
    ConfigError,
    ConfigProblem,
    closest,
    problems_from_validation,
    unknown_key_problem,
)
from zerotrain.config.legacy import apply_legacy_spellings
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.source import read_config_source
from zerotrain.config.types import LooseSection
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

UnknownKeys = Literal["error", "warn"]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The Section model inside an annotation such as ``FooConfig | None``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None if issubclass(annotation, LooseSection) else annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _nested_model(arg)
            if found is not None:
                return found
    return None


def _split_unknown(
    raw: dict[str, Any], model: type[BaseModel], path: tuple[str, ...]
) -> list[ConfigProblem]:
    """Remove keys ``model`` does not define from ``raw`` (recursively); return one problem each."""
    problems: list[ConfigProblem] = []
    fields = model.model_fields
    for key in list(raw):
        if key not in fields:
            problems.append(unknown_key_problem(".".join((*path, key)), key, fields))
            del raw[key]
            continue
        sub = _nested_model(fields[key].annotation)
        if sub is not None and isinstance(raw[key], dict):
            problems += _split_unknown(raw[key], sub, (*path, key))
    return problems


def _strict(raw: dict[str, Any]) -> bool:
    """The config's own ``zerotrain.strict_config`` (its type is checked with the rest)."""
    options = raw.get("zerotrain")
    return isinstance(options, dict) and options.get("strict_config") is True


def _ignored_top_level_key(key: str) -> str:
    """The warning for an unknown top-level key, naming the nearest known one."""
    known = list(ZeroTrainConfig.model_fields)
    # A likely typo first; else the most similar key, however far (cutoff 0 always finds one).
    nearest = closest(key, known) or difflib.get_close_matches(key, known, n=1, cutoff=0.0)[0]
    return (
        f"ignoring unknown top-level key '{key}'; the nearest known key is '{nearest}' "
        "(DeepSpeed ignores such keys too; zerotrain.strict_config: true makes them errors)"
    )


def _fold_max_grad_norm(raw: dict[str, Any]) -> list[ConfigProblem]:
    """Old configs put ``max_grad_norm`` in ``optimizer.params``; it means gradient_clipping."""
    params = (raw.get("optimizer") or {}).get("params")
    if not isinstance(params, dict) or "max_grad_norm" not in params:
        return []
    value = params.pop("max_grad_norm")
    current = raw.get("gradient_clipping")
    if current not in (None, 0, 0.0) and current != value:
        return [
            ConfigProblem(
                "optimizer.params.max_grad_norm",
                f"got {value!r}, but gradient_clipping is {current!r}; they mean the same "
                "thing (clip gradients by global norm), keep only gradient_clipping",
            )
        ]
    raw["gradient_clipping"] = value
    return []


def _params_model(
    raw: dict[str, Any], kind: Literal["optimizer", "scheduler"]
) -> tuple[type[BaseModel] | None, list[ConfigProblem]]:
    """The params model for ``raw[kind].type`` (None when there is nothing to check)."""
    section = raw.get(kind)
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        return None, []  # missing/ill-typed section: schema validation reports it
    type_name = section["type"]
    model = optim_params.params_model(kind, type_name)
    if model is not None:
        return model, []
    if kind == "optimizer":
        if optim_params.canonical_optimizer(type_name) in optim_params.OPTIMIZERS_NOT_IMPLEMENTED:
            return None, []  # a known name: features.py reports "not implemented" at initialize
        known = [*optim_params.OPTIMIZER_PARAMS, *optim_params.OPTIMIZERS_NOT_IMPLEMENTED]
        display = [optim_params.OPTIMIZER_DISPLAY[k] for k in known]
    else:
        if optim_params.canonical_scheduler(type_name) in optim_params.SCHEDULERS_NOT_IMPLEMENTED:
            return None, []
        display = [*optim_params.SCHEDULER_PARAMS, *optim_params.SCHEDULERS_NOT_IMPLEMENTED]
    guess = closest(type_name, display)
    hint = f"did you mean '{guess}'?" if guess else f"allowed: {', '.join(display)}"
    return None, [ConfigProblem(f"{kind}.type", f"unknown {kind} type '{type_name}'; {hint}")]


def _validate_typed_params(
    raw: dict[str, Any], kind: Literal["optimizer", "scheduler"], model: type[BaseModel]
) -> list[ConfigProblem]:
    """Check ``raw[kind].params`` against ``model``; normalise it and the type name in place."""
    section = raw[kind]
    params = section.get("params", {})
    if not isinstance(params, dict):
        return []  # schema validation reports the wrong type
    try:
        typed = model.model_validate(params)
    except ValidationError as exc:
        return problems_from_validation(exc, prefix=(kind, "params"))
    # Keep only what the user wrote (normalised), so "explicitly set" stays visible.
    section["params"] = typed.model_dump(exclude_unset=True)
    type_name = section["type"]
    section["type"] = (
        optim_params.OPTIMIZER_DISPLAY[optim_params.canonical_optimizer(type_name)]
        if kind == "optimizer"
        else optim_params.canonical_scheduler(type_name)
    )
    return []


def _effective_value(cfg: ZeroTrainConfig, path: tuple[str, ...]) -> Any:
    """The value a key ends up with, defaults of typed optimizer/scheduler params included."""
    node: Any = cfg.model_dump()
    section = getattr(cfg, path[0], None)
    if path[0] in ("optimizer", "scheduler") and len(path) > 2 and section is not None:
        model = optim_params.params_model(path[0], section.type)
        if model is not None:
            node = {path[0]: {"params": model.model_validate(section.params).model_dump()}}
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _auto_note(cfg: ZeroTrainConfig, resolution: AutoResolution) -> str:
    dotted = ".".join(resolution.path)
    if resolution.how == "derived":
        return f'{dotted}: "auto" -> derived from the other batch sizes and the world size'
    source = "optimizer lr" if resolution.how == "optimizer_lr" else "default"
    value = _effective_value(cfg, resolution.path)
    if value is None:
        return f'{dotted}: "auto" -> unset (zerotrain chooses; see docs/config.md)'
    return f'{dotted}: "auto" -> {value!r} ({source})'


def _first_per_path(problems: list[ConfigProblem]) -> list[ConfigProblem]:
    # A key removed by an earlier stage (an unfillable "auto") may be reported again as
    # "missing" by validation; the first, more specific message is the useful one.
    seen: set[str] = set()
    kept = []
    for problem in problems:
        if problem.path not in seen:
            kept.append(problem)
            seen.add(problem.path)
    return kept


def load_config(
    config: str | os.PathLike[str] | dict[str, Any] | ZeroTrainConfig | None,
    *,
    argv: Sequence[str] | None = None,
    unknown_keys: UnknownKeys | None = None,
) -> ZeroTrainConfig:
    """Load and validate a config.

    Args:
        config: a dict, a path to a JSON file, an already-loaded config, or None to read the
            path from ``--config`` in ``argv``.
        argv: command-line arguments searched when ``config`` is None (default ``sys.argv``).
        unknown_keys: what to do with keys the schema does not know. By default, as
            DeepSpeed: an unknown top-level key is logged (with the nearest known key) and
            dropped, an unknown key inside a section is an error. ``"error"`` (or the
            config's ``zerotrain.strict_config: true``) refuses top-level ones too;
            ``"warn"`` logs and drops every unknown key, for migrating configs. The
            environment variable ``ZEROTRAIN_UNKNOWN_KEYS`` sets the default.

    Returns:
        The validated config. Batch sizes are still as written: they are resolved against the
        world size by :func:`zerotrain.config.batch.resolve_batch_sizes`.

    Raises:
        ConfigError: listing every problem found, each with its path and what is allowed.
    """
    if isinstance(config, ZeroTrainConfig):
        return config
    mode = unknown_keys or os.environ.get("ZEROTRAIN_UNKNOWN_KEYS") or None
    if mode not in (None, "error", "warn"):
        raise ValueError(f"unknown_keys must be 'error' or 'warn', got {mode!r}")
    raw, source = read_config_source(config, argv)
    raw = copy.deepcopy(raw)
    if _strict(raw):
        mode = "error"

    problems, legacy_notes = apply_legacy_spellings(raw)
    problems += _fold_max_grad_norm(raw)
    # Unknown keys first: a misspelt key set to "auto" must not be resolved away silently.
    top_level = {key for key in raw if key not in ZeroTrainConfig.model_fields}
    unknown = _split_unknown(raw, ZeroTrainConfig, ())
    if mode is None:  # DeepSpeed's way: it drops unknown top-level keys without a word
        for key in sorted(top_level):
            log.warning("%s: %s", source or "config", _ignored_top_level_key(key))
        unknown = [p for p in unknown if p.path not in top_level]
    models: dict[Literal["optimizer", "scheduler"], type[BaseModel]] = {}
    kinds: tuple[Literal["optimizer", "scheduler"], ...] = ("optimizer", "scheduler")
    for kind in kinds:
        model, type_problems = _params_model(raw, kind)
        problems += type_problems
        if model is not None:
            models[kind] = model
            params = raw[kind].get("params")
            if isinstance(params, dict):
                unknown += _split_unknown(params, model, (kind, "params"))
    resolutions, auto_problems = resolve_auto(raw)
    problems += auto_problems
    for kind, model in models.items():
        problems += _validate_typed_params(raw, kind, model)

    if mode == "warn":
        for problem in unknown:
            log.warning("%s: ignoring %s (unknown_keys='warn')", source, problem)
    else:
        problems = unknown + problems

    cfg: ZeroTrainConfig | None = None
    try:
        cfg = ZeroTrainConfig.model_validate(raw)
    except ValidationError as exc:
        problems += problems_from_validation(exc)
    if problems or cfg is None:
        problems = _first_per_path(problems)
        raise ConfigError(problems, source)

    cfg._auto_notes = tuple(legacy_notes) + tuple(_auto_note(cfg, r) for r in resolutions)
    return cfg

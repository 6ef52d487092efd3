"""Choosing what the engine steps: the config's optimizer, the user's, or one built by a
callable; and the learning-rate schedule driving it.

With nothing partitioned (stage 0) a user optimizer keeps stepping the model's own
parameters, whose gradients are views of the reduced flat gradients. When optimizer states
are partitioned (stages >= 1), every optimizer runs over this rank's flat shards: the
config's optimizer directly, a user optimizer by rebuilding its class over the shards (only
for optimizers known to be elementwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.config.policies import OptimizerSpec, SchedulerSpec
from zerotrain.engine.compressed_setup import build_compressed, is_compressed
from zerotrain.engine.param_groups import ParamGroups
from zerotrain.optim.base import FlatOptimizer
from zerotrain.optim.deepspeed_ops import layout_free_options, spec_of
from zerotrain.optim.factory import (
    ELEMENTWISE_TORCH_OPTIMIZERS,
    FlatGroup,
    build_optimizer,
    build_scheduler,
    check_group_options,
    hyperparameters,
    rebuild_over_flat,
)
from zerotrain.optim.lamb import Lamb
from zerotrain.utils.logging import get_logger
from zerotrain.zero.strategy import ZeroStrategy

log = get_logger(__name__)


@dataclass(frozen=True)
class EngineOptimizer:
    """The optimizer and whether it holds the model's own parameters (else flat shards)."""

    optimizer: torch.optim.Optimizer | None
    steps_model_params: bool


def flat_groups(strategy: ZeroStrategy, groups: ParamGroups) -> list[FlatGroup]:
    """One flat group per optimizer group, on every rank: a group none of whose elements
    this rank owns gets an empty placeholder, so every rank has the same groups (per-group
    collectives such as LAMB's norms, per-group schedules and ``get_lr()`` line up)."""
    flat = []
    for g, options in enumerate(groups.options):
        pieces = strategy.pieces(g)
        tensors = [p.param for p in pieces] or [strategy.placeholder(g)]
        segments = [p.segments for p in pieces] or [()]
        flat.append(FlatGroup(tensors, segments, dict(options), num_ids=strategy.num_params))
    return flat


def _check_built(built: Any) -> torch.optim.Optimizer:
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer"
        )
    return built


def make_optimizer(
    optimizer: Any,
    spec: OptimizerSpec | None,
    strategy: ZeroStrategy,
    groups: ParamGroups,
    model_parameters: list[Any] | None,
) -> EngineOptimizer:
    """Build the engine's optimizer from what ``initialize`` received (one of DeepSpeed's
    optimizer classes, ``optim.deepspeed_ops``, counts as the config section it names)."""
    if optimizer is not None and spec is not None:
        # DeepSpeed's rule: the client optimizer wins over the config's section.
        log.warning(
            "an optimizer was passed to initialize and the config has an 'optimizer' section "
            "(%s): the one passed in is used, as DeepSpeed does; remove one of them",
            spec.name,
        )
        spec = None
    named = spec_of(optimizer)
    if named is not None:
        # DeepSpeedCPUAdam / FusedAdam / FusedLamb name zerotrain's Adam and LAMB: build
        # exactly what the config's section with these values builds (offload included).
        log.info(
            "%s passed to initialize: the engine runs its %s with the same hyper-parameters "
            "and groups; step the optimizer returned by initialize",
            type(optimizer).__name__,
            named.name,
        )
        groups.options[:] = [layout_free_options(o) for o in groups.options]
        optimizer, spec = None, named
    sharded = strategy.optimizer_over_shards
    if spec is not None and is_compressed(spec):
        flat = flat_groups(strategy, groups)
        param_groups = [{"params": g.tensors, **g.options} for g in flat]
        return EngineOptimizer(
            build_compressed(spec, strategy, groups, param_groups), steps_model_params=False
        )
    if strategy.offload is not None:
        return _offloaded(optimizer, spec, strategy, groups)
    if spec is not None:
        flat = flat_groups(strategy, groups)
        return EngineOptimizer(
            build_optimizer(spec, flat, strategy.shard_norm_reducer()), steps_model_params=False
        )
    if optimizer is None:
        log.warning(
            "no optimizer (none passed, none in the config): step() only averages "
            "gradients and never updates parameters"
        )
        return EngineOptimizer(None, steps_model_params=False)
    if isinstance(optimizer, torch.optim.Optimizer):
        if not sharded:
            return EngineOptimizer(optimizer, steps_model_params=True)
        why = (
            f"ZeRO stage {strategy.zero.stage} partitions optimizer states"
            if strategy.zero.shard_optimizer
            else "mixed precision steps fp32 master weights"
        )
        log.warning(
            "%s is rebuilt over this rank's shards (%s); step the optimizer returned by "
            "initialize, not the one passed in",
            type(optimizer).__name__,
            why,
        )
        return EngineOptimizer(rebuild_over_flat(optimizer, flat_groups(strategy, groups)), False)
    if callable(optimizer):
        if not sharded:
            params = model_parameters or [t.param for t in groups.trainable]
            return EngineOptimizer(_check_built(optimizer(params)), steps_model_params=True)
        from_callable = _check_built(
            optimizer([{"params": g.tensors, **g.options} for g in flat_groups(strategy, groups)])
        )
        _check_elementwise(from_callable)
        return EngineOptimizer(from_callable, steps_model_params=False)
    raise TypeError("optimizer must be a torch.optim.Optimizer, a callable(params) or None")


def _offloaded(
    optimizer: Any, spec: OptimizerSpec | None, strategy: ZeroStrategy, groups: ParamGroups
) -> EngineOptimizer:
    """Offload runs its own Adam over the pieces, streaming states through its buffers."""
    assert strategy.offload is not None
    if optimizer is not None:
        spec = _adam_spec_of(optimizer)
    if spec is None:
        log.warning("offload is configured but there is no optimizer: step() only averages")
        return EngineOptimizer(None, steps_model_params=False)
    if spec.name not in ("adam", "adamw"):
        raise ValueError(
            f"offloaded optimizer steps run Adam or AdamW; the config names '{spec.name}'"
        )
    hyper = hyperparameters(spec)
    flat = flat_groups(strategy, groups)
    if optimizer is not None:
        # A client optimizer's groups carry torch's implementation flags (foreach, fused,
        # decoupled_weight_decay, ...): the offloaded step has its own kernel.
        for group in flat:
            group.options = {k: v for k, v in group.options.items() if k in hyper}
    check_group_options(list(hyper), [g.options for g in flat])
    built = strategy.offload.build_optimizer(hyper, flat, strategy.units)
    return EngineOptimizer(built, steps_model_params=False)


def _adam_spec_of(optimizer: Any) -> OptimizerSpec:
    """The offloaded step's hyper-parameters, read from a client ``torch.optim.Adam`` or
    ``AdamW`` (DeepSpeed-Chat and the transformers Trainer pass one with offload configs).

    Raises:
        ValueError: anything else (the offloaded step runs Adam only and cannot call another
            optimizer's code on the streamed states).
    """
    refusal = (
        "with zero_optimization.offload_optimizer/offload_param the step runs zerotrain's "
        "offloaded Adam on the streamed states; the optimizer passed to initialize must be a "
        "torch.optim.Adam or AdamW (its hyper-parameters are used), or give an 'optimizer' "
        f"section (Adam or AdamW) instead; got {type(optimizer).__name__}"
    )
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(refusal)
    defaults = optimizer.defaults
    if defaults.get("maximize") or defaults.get("differentiable"):
        raise ValueError(f"{refusal} without maximize/differentiable")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        defaults.get("decoupled_weight_decay")
    )
    params = {
        "lr": float(defaults["lr"]),
        "betas": tuple(float(b) for b in defaults["betas"]),
        "eps": float(defaults["eps"]),
        "weight_decay": float(defaults["weight_decay"]),
        "amsgrad": bool(defaults.get("amsgrad", False)),
        "bias_correction": True,
        "adam_w_mode": decoupled,
    }
    log.info(
        "offload: the step runs zerotrain's offloaded Adam with the hyper-parameters of the "
        "%s passed to initialize (%s)",
        type(optimizer).__name__,
        ", ".join(f"{k}={v}" for k, v in params.items()),
    )
    return OptimizerSpec("adamw" if decoupled else "adam", params)


def _check_elementwise(built: torch.optim.Optimizer) -> None:
    if isinstance(built, Lamb) or not isinstance(
        built, (FlatOptimizer, *ELEMENTWISE_TORCH_OPTIMIZERS)
    ):
        raise TypeError(
            f"the optimizer callable built {type(built).__name__}, which zerotrain cannot run on "
            "partitioned shards (its update may depend on whole parameters); use an elementwise "
            "torch optimizer or the config's 'optimizer' section"
        )


def make_scheduler(
    lr_scheduler: Any, spec: SchedulerSpec | None, optimizer: torch.optim.Optimizer | None
) -> Any:
    """Build the schedule from the config, or adopt the user's object or callable."""
    if lr_scheduler is not None and spec is not None:
        raise ValueError(
            "an lr_scheduler was passed to initialize and the config has a 'scheduler' "
            "section; use one of them"
        )
    if lr_scheduler is None and spec is None:
        return None
    if optimizer is None:
        raise ValueError("a learning-rate schedule needs an optimizer")
    if spec is not None:
        return build_scheduler(spec, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    if getattr(lr_scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            "the lr_scheduler passed to initialize drives a different optimizer than the one "
            "the engine steps (zerotrain builds its own over this rank's shards when optimizer "
            "states are partitioned); pass the scheduler as a callable "
            "(lambda optimizer: ...) so it is built for the optimizer in use"
        )
    return lr_scheduler

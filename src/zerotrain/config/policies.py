"""The validated config turned into small frozen dataclasses, one per component.

Components below ``config`` receive only their own policy (never the whole config), so the
coupling between a component and the config keys it reads is visible in its signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from zerotrain.config import optim_params
from zerotrain.config.batch import BatchSizes, resolve_batch_sizes
from zerotrain.config.schema import ZeroTrainConfig


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """An optimizer named in the config: ``name`` is lower-case (adam/adamw/sgd/lamb) and
    ``params`` holds every hyperparameter, defaults filled in."""

    name: str
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """A learning-rate schedule named in the config, defaults filled in."""

    name: str
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class GradReducePolicy:
    """How gradients are averaged across data-parallel ranks, in buckets of ``bucket_numel``
    elements.

    Gradients are multiplied by ``1 / pre_divide`` before the reduction and divided by
    ``post_divide`` after it; ``pre_divide * post_divide == world_size``, so the result is the
    mean. Splitting the division keeps fp16 sums in range (DeepSpeed's
    ``prescale_gradients`` / ``gradient_predivide_factor``).
    """

    bucket_numel: int | None  # None: sized from the model
    overlap: bool | None  # None: on for GPUs, off for CPUs (see zero/strategy.py)
    pre_divide: float
    post_divide: float


@dataclass(frozen=True, slots=True)
class Stage3Policy:
    """Stage-3 gathering (DeepSpeed's ``stage3_*`` keys), sizes in elements.

    ``unit_classes``: class names whose modules become units (None: the repeated blocks).
    """

    prefetch_numel: int
    persistence_threshold: int
    max_live_numel: int
    unit_classes: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class TrainingPolicy:
    """Step-level settings the engine reads."""

    batch: BatchSizes
    stage: int
    clip_norm: float
    steps_per_print: int
    log_memory: bool
    drop_last: bool


@dataclass(frozen=True, slots=True)
class Policies:
    """Everything ``initialize`` needs from the config."""

    training: TrainingPolicy
    grad_reduce: GradReducePolicy
    stage3: Stage3Policy
    optimizer: OptimizerSpec | None
    scheduler: SchedulerSpec | None


def _spec(kind: str, type_name: str, params: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    model = optim_params.params_model(kind, type_name)
    full = model.model_validate(dict(params)).model_dump() if model is not None else dict(params)
    name = (
        optim_params.canonical_optimizer(type_name)
        if kind == "optimizer"
        else optim_params.canonical_scheduler(type_name)
    )
    return name, MappingProxyType(full)


def to_policies(cfg: ZeroTrainConfig, dp_world_size: int) -> Policies:
    """Resolve batch sizes against ``dp_world_size`` and split the config per component.

    Raises:
        ConfigError: when the batch sizes are inconsistent with the world size.
    """
    batch = resolve_batch_sizes(
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        dp_world_size,
    )
    zero = cfg.zero_optimization
    if cfg.prescale_gradients:
        pre, post = float(dp_world_size), 1.0
    else:
        pre = cfg.gradient_predivide_factor
        post = dp_world_size / cfg.gradient_predivide_factor
    grad_reduce = GradReducePolicy(
        bucket_numel=zero.reduce_bucket_size,
        overlap=zero.overlap_comm,
        pre_divide=pre,
        post_divide=post,
    )
    stage3 = Stage3Policy(
        prefetch_numel=zero.stage3_prefetch_bucket_size,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        max_live_numel=zero.stage3_max_live_parameters,
        unit_classes=tuple(zero.stage3_unit_classes) if zero.stage3_unit_classes else None,
    )
    training = TrainingPolicy(
        batch=batch,
        stage=zero.stage,
        clip_norm=cfg.gradient_clipping,
        steps_per_print=cfg.steps_per_print,
        log_memory=cfg.memory_breakdown,
        drop_last=cfg.dataloader_drop_last,
    )
    optimizer = scheduler = None
    if cfg.optimizer is not None:
        optimizer = OptimizerSpec(*_spec("optimizer", cfg.optimizer.type, cfg.optimizer.params))
    if cfg.scheduler is not None:
        scheduler = SchedulerSpec(*_spec("scheduler", cfg.scheduler.type, cfg.scheduler.params))
    return Policies(training, grad_reduce, stage3, optimizer, scheduler)

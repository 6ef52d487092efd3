"""``zerotrain.initialize``: config + model (+ optimizer, data) -> a ready training engine.

The order is fixed and readable: load the config, refuse features this version cannot run,
join the process group, check every rank built the same model, make the ranks' initial
states identical, pack parameters into units, build the optimizer and schedule, and hook
gradient reduction into autograd.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.comm.collectives import Communicator
from zerotrain.comm.env import init_distributed
from zerotrain.config.features import inert_keys, not_implemented
from zerotrain.config.loader import load_config
from zerotrain.config.policies import OptimizerSpec, to_policies
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.engine.data import DistributedDataLoader
from zerotrain.engine.engine import Engine
from zerotrain.engine.param_groups import ParamGroups, resolve_param_groups
from zerotrain.optim.factory import FlatGroup, build_optimizer, build_scheduler
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.logging import get_logger
from zerotrain.zero.grad_sync import GradientSynchronizer
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.units import build_units

log = get_logger(__name__)

_INIT_BUCKET_NUMEL = 50_000_000


def _config_from_args(config: Any, config_params: Any, args: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("pass the config as config= or config_params=, not both")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "config", None)
    return config


def _refuse_unimplemented(cfg: ZeroTrainConfig) -> None:
    missing = not_implemented(cfg)
    if missing:
        lines = "\n".join(f"  - {item}" for item in missing)
        raise NotImplementedError(
            f"this config enables features zerotrain does not implement yet:\n{lines}\n"
            "Disable them (or remove the keys) to train with what is available."
        )


def _check_same_model(comm: Communicator, model: nn.Module) -> None:
    """Fail fast if ranks built different models: mismatched collectives would hang."""
    signature = "|".join(
        f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
        for name, p in model.named_parameters()
    )
    digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:6], "big")
    high, neg_low = comm.all_reduce_floats([float(digest), -float(digest)], op="max")
    if high != -neg_low:
        raise RuntimeError(
            f"rank {comm.rank}: the ranks built different models (parameter names, shapes, "
            "dtypes or requires_grad differ); every rank must construct the same model"
        )


def _flat_groups(units: list[ShardedUnit], groups: ParamGroups) -> list[FlatGroup]:
    flat: list[FlatGroup] = []
    for g, options in enumerate(groups.options):
        members = [u for u in units if u.group_index == g]
        if not members:
            log.info("optimizer group %d has no trainable parameters; skipped", g)
            continue
        segments = [
            tuple((spec.start, spec.end) for spec in u.buffer.layout.params) for u in members
        ]
        flat.append(FlatGroup([u.optimizer_param() for u in members], segments, dict(options)))
    return flat


def _build_optimizer(
    optimizer: Any,
    spec: OptimizerSpec | None,
    units: list[ShardedUnit],
    groups: ParamGroups,
    model_parameters: Any,
) -> torch.optim.Optimizer | None:
    if optimizer is not None and spec is not None:
        raise ValueError(
            "an optimizer was passed to initialize and the config has an 'optimizer' section; "
            "use one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer  # stage 0: it steps the model's own parameters (views into units)
    if callable(optimizer):
        params = (
            model_parameters
            if model_parameters is not None
            else [t.param for t in groups.trainable]
        )
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned {type(built).__name__}, "
                "not a torch.optim.Optimizer"
            )
        return built
    if optimizer is not None:
        raise TypeError("optimizer must be a torch.optim.Optimizer, a callable(params) or None")
    if spec is None:
        log.warning(
            "no optimizer (none passed, none in the config): step() only averages "
            "gradients and never updates parameters"
        )
        return None
    return build_optimizer(spec, _flat_groups(units, groups))


def _build_scheduler(lr_scheduler: Any, cfg_spec: Any, optimizer: Any) -> Any:
    if lr_scheduler is not None and cfg_spec is not None:
        raise ValueError(
            "an lr_scheduler was passed to initialize and the config has a 'scheduler' "
            "section; use one of them"
        )
    if lr_scheduler is None and cfg_spec is None:
        return None
    if optimizer is None:
        raise ValueError("a learning-rate schedule needs an optimizer")
    if cfg_spec is not None:
        return build_scheduler(cfg_spec, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: str | os.PathLike[str] | dict[str, Any] | ZeroTrainConfig | None = None,
    config_params: dict[str, Any] | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
) -> tuple[Engine, torch.optim.Optimizer | None, DistributedDataLoader | None, Any]:
    """Prepare ``model`` for data-parallel training with ZeRO.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` (or ``config``) attribute is
            used when ``config`` is not given.
        model: the model; it is moved to this rank's device.
        optimizer: a torch optimizer, a callable ``params -> optimizer``, or None to build the
            one in the config's ``optimizer`` section.
        model_parameters: parameters or param-group dicts for the optimizer (default: every
            parameter that requires grad).
        training_data: a Dataset; if given, a distributed DataLoader over it is returned.
        lr_scheduler: a scheduler, a callable ``optimizer -> scheduler``, or None to build
            the config's ``scheduler``.
        collate_fn: batch builder for the returned DataLoader.
        config: a dict, a path to a JSON file, or None to read ``--config PATH`` from argv.
        config_params: alias of ``config`` (DeepSpeed's older name).
        mpu: model-parallel unit (not supported yet; must be None).
        dist_init_required: accepted for compatibility; the process group is always set up
            when missing and reused when present.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; dataloader and scheduler may be None.

    Raises:
        ConfigError: the config is invalid (every problem listed).
        NotImplementedError: the config enables a feature this version does not have.
    """
    del dist_init_required  # always handled: see the docstring
    if model is None:
        raise TypeError("initialize() needs model=")
    if mpu is not None:
        raise NotImplementedError("model parallelism through mpu= is not implemented yet")
    cfg = load_config(_config_from_args(config, config_params, args))
    _refuse_unimplemented(cfg)

    env = init_distributed()
    comm = Communicator(timeout=env.timeout)
    policies = to_policies(cfg, comm.world_size)
    for note in (*cfg.auto_notes, *inert_keys(cfg)):
        log.info("config: %s", note)

    model.to(env.device)
    _check_same_model(comm, model)
    with torch.no_grad():
        state = [p.data for p in model.parameters()] + list(model.buffers())
        broadcast_tensors(comm, state, _INIT_BUCKET_NUMEL, src=0)

    if optimizer is not None and not callable(optimizer) and model_parameters is not None:
        log.warning(
            "model_parameters is ignored: the optimizer passed to initialize "
            "already defines its parameter groups"
        )
    user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    groups = resolve_param_groups(model, model_parameters, user_optimizer)
    zero = ZeroPolicy.for_stage(policies.training.stage)
    units = build_units(
        groups.trainable, policies.grad_reduce.bucket_numel, comm, zero, policies.grad_reduce
    )
    sync = GradientSynchronizer(units, overlap=policies.grad_reduce.overlap)
    opt = _build_optimizer(optimizer, policies.optimizer, units, groups, model_parameters)
    scheduler = _build_scheduler(lr_scheduler, policies.scheduler, opt)

    loader = None
    if training_data is not None:
        loader = DistributedDataLoader(
            training_data,
            policies.training.batch.micro_batch_size,
            comm.rank,
            comm.world_size,
            collate_fn=collate_fn,
            drop_last=policies.training.drop_last,
            pin_memory=env.device.type == "cuda",
        )
    engine = Engine(model, env, comm, policies.training, units, sync, opt, scheduler)
    batch = policies.training.batch
    log.info(
        "initialized: ZeRO stage %d, %d rank(s), %d parameters in %d unit(s), batch %d = %d "
        "micro x %d accumulation x %d ranks",
        zero.stage,
        comm.world_size,
        sum(u.numel for u in units),
        len(units),
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
        batch.dp_world_size,
    )
    return engine, opt, loader, scheduler

"""``zerotrain.initialize``: config + model (+ optimizer, data) -> a ready training engine.

The order is fixed and readable: load the config, refuse features this version cannot run,
join the process group, check every rank built the same model, make the ranks' initial
states identical, pack parameters into units, build the optimizer and schedule, and hook
gradient reduction into autograd.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain import checkpointing
from zerotrain.comm import public as comm_public
from zerotrain.comm.agreement import disagreements, failed_ranks
from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.comm.collectives import Communicator
from zerotrain.comm.env import DistEnv, init_distributed
from zerotrain.config.features import (
    ignored_keys,
    inert_keys,
    not_implemented,
    pipeline_stages,
    tensor_parallel_size,
)
from zerotrain.config.loader import load_config
from zerotrain.config.policies import ActivationCheckpointingPolicy, Policies, to_policies
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.engine.compressed_setup import check_compressed, is_compressed
from zerotrain.engine.data import DistributedDataLoader
from zerotrain.engine.efficiency import setup_training_efficiency
from zerotrain.engine.engine import Engine
from zerotrain.engine.lr_find import LRFindRequest, LRRangeRecorder
from zerotrain.engine.optimizers import EngineOptimizer, make_optimizer, make_scheduler
from zerotrain.engine.param_groups import ParamGroups, resolve_param_groups
from zerotrain.engine.pipeline_engine import PipelineEngine
from zerotrain.engine.pipeline_setup import (
    check_tied_units,
    pipeline_topology,
    prepare_pipeline,
    tied_groups,
)
from zerotrain.engine.sequence_setup import distinct_random_streams, route_attention
from zerotrain.engine.sparse_setup import setup_sparse_attention
from zerotrain.engine.telemetry import TelemetryPolicy, predict_memory, telemetry_policy
from zerotrain.engine.tensor_setup import split_model, tensor_plan
from zerotrain.estimate import MemoryEstimate
from zerotrain.offload.manager import Offload
from zerotrain.parallel.groups import ProcessGroups
from zerotrain.parallel.pipeline.module import PipelineModule
from zerotrain.parallel.pipeline.schedule import PipelineSchedule
from zerotrain.parallel.tensor.sequence_parallel import (
    restore_gradient_sums,
    take_over_gradient_sums,
)
from zerotrain.parallel.topology import Topology
from zerotrain.precision.dtypes import check_device_supports
from zerotrain.utils.logging import get_logger
from zerotrain.zero.init import DeferredValues, deferred_values, materialize
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.strategy import Stage3Options, ZeroStrategy

log = get_logger(__name__)

_INIT_BUCKET_NUMEL = 50_000_000


def _config_from_args(config: Any, config_params: Any, args: Any) -> Any:
    """The config ``initialize`` was given: ``config=``, ``config_params=`` or the
    ``--deepspeed_config`` of ``args`` (DeepSpeed's ``add_config_arguments``), exactly one."""
    if config is not None and config_params is not None:
        raise ValueError("pass the config as config= or config_params=, not both")
    if config is None:
        config = config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None)
        deprecated = getattr(args, "deepscale_config", None)
        if deprecated is not None:
            if from_args is not None:
                raise ValueError(
                    "args has both --deepscale_config and --deepspeed_config; give only "
                    "--deepspeed_config (--deepscale_config is its deprecated name)"
                )
            log.warning("--deepscale_config is deprecated; use --deepspeed_config")
            from_args = deprecated
    if from_args is not None and config is not None:
        # DeepSpeed asserts here too: which of the two was meant cannot be guessed.
        raise ValueError(
            f"initialize() got a config both as an argument and in args.deepspeed_config "
            f"({from_args!r}); pass one of them"
        )
    if config is None and args is not None:
        config = from_args or getattr(args, "config", None)
    return config


def _refuse_unimplemented(cfg: ZeroTrainConfig) -> None:
    missing = not_implemented(cfg)
    if missing:
        lines = "\n".join(f"  - {item}" for item in missing)
        raise NotImplementedError(
            f"this config enables features zerotrain does not implement yet:\n{lines}\n"
            "Disable them (or remove the keys) to train with what is available."
        )


def _check_same_model(comm: Communicator, model: nn.Module, world: Communicator) -> None:
    """Fail fast, naming the parameter, if the ranks of ``comm`` built different models:
    mismatched collectives would hang or exchange the wrong values. Every rank of ``world``
    stops together (pipeline stages compare within their own group)."""
    items = [
        (
            f"parameter #{k}",
            f"'{name}' {tuple(p.shape)} {p.dtype}{'' if p.requires_grad else ' frozen'}",
        )
        for k, (name, p) in enumerate(model.named_parameters())
    ]
    differing = disagreements(comm, items)
    failed = failed_ranks(world, bool(differing)) if world is not comm else []
    if differing:
        raise RuntimeError(
            f"rank {comm.rank}: the ranks built different models; every rank must construct "
            "the same model. Differing (parameters in registration order):\n  "
            + "\n  ".join(differing)
        )
    if failed:
        raise RuntimeError(
            f"rank {world.rank}: ranks {failed} built models that differ from their replicas' "
            "(see their errors); every rank stops"
        )


# Config values that may differ between ranks: paths on each node's own disks.
_PER_RANK_KEYS = frozenset({"nvme_path"})


def _config_items(value: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [
            item
            for key in sorted(value)
            if key not in _PER_RANK_KEYS
            for item in _config_items(value[key], f"{path}.{key}" if path else key)
        ]
    return [(path, repr(value))]


def _check_same_config(comm: Communicator, cfg: ZeroTrainConfig) -> None:
    """Fail on every rank, naming the keys, if ranks were given different configs (a
    learning rate or a batch size that differs trains silently wrong)."""
    differing = disagreements(comm, _config_items(cfg.model_dump(mode="json")))
    if differing:
        raise ValueError(
            f"rank {comm.rank}: the ranks were given different configs; every rank must use "
            "the same one. Differing keys:\n  " + "\n  ".join(differing)
        )


def _resolve_topology(
    given: Topology | None, cfg: ZeroTrainConfig, world_size: int, model: nn.Module
) -> Topology:
    """The grid: a PipelineModule's own, ``given``, or the config's sizes with data
    parallelism over the rest."""
    if isinstance(model, PipelineModule):
        stages = cfg.pipeline.stages if cfg.pipeline is not None else None
        grid = pipeline_topology(
            model, given, stages if isinstance(stages, int) else None, world_size
        )
        if cfg.sequence_parallel_size > 1 and grid.sequence != cfg.sequence_parallel_size:
            raise ValueError(
                f"the PipelineModule's grid {grid} has a sequence axis of {grid.sequence}, but "
                f"the config's sequence_parallel_size is {cfg.sequence_parallel_size}; build "
                "the module with a Topology(sequence=...) that matches"
            )
        return grid
    if pipeline_stages(cfg) > 1 or (given is not None and given.pipe > 1):
        raise ValueError(
            "pipeline parallelism (pipeline.stages or topology pipe > 1) needs the model as a "
            "zerotrain.pipe.PipelineModule: its layers are split into stages when it is built"
        )
    if given is None:
        return Topology.from_world(
            world_size,
            pipe=pipeline_stages(cfg),
            tensor=tensor_parallel_size(cfg),
            sequence=cfg.sequence_parallel_size,
        )
    if not isinstance(given, Topology):
        raise TypeError(f"topology= must be a zerotrain.parallel.Topology, got {given!r}")
    if cfg.tensor_parallel is not None and given.tensor != tensor_parallel_size(cfg):
        raise ValueError(
            f"topology {given} has a tensor axis of {given.tensor}, but the config's "
            f"tensor_parallel.autotp_size is {tensor_parallel_size(cfg)}; make them equal"
        )
    if given.sequence != cfg.sequence_parallel_size and cfg.sequence_parallel_size > 1:
        raise ValueError(
            f"topology {given} has a sequence axis of {given.sequence}, but the config's "
            f"sequence_parallel_size is {cfg.sequence_parallel_size}; make them equal"
        )
    if given.world_size != world_size:
        raise ValueError(
            f"topology {given} has {given.world_size} ranks, but the job has {world_size} "
            "processes: pipe x data x sequence x tensor must equal the number of processes"
        )
    return given


def _tensor_parallel_plan(
    cfg: ZeroTrainConfig, model: nn.Module, groups: ProcessGroups
) -> tuple[dict[str, str], str] | None:
    """The plan splitting ``model`` over the tensor axis, or None (no axis, or replicated
    compute: a topology with a tensor axis, no config section and a model without a plan)."""
    degree = groups.tensor.world_size
    if degree == 1:
        return None
    if cfg.tensor_parallel is None and not getattr(model, "_tp_plan", None):
        log.warning(
            "the topology has a tensor axis of %d but nothing says how to split %s (no "
            "tensor_parallel section, no _tp_plan): its ranks run replicated compute",
            degree,
            type(model).__name__,
        )
        return None
    return tensor_plan(cfg, model)


def _partition_group(cfg: ZeroTrainConfig, groups: ProcessGroups) -> Communicator | None:
    """The group ``activation_checkpointing.partition_activations`` splits checkpointed
    inputs over: the tensor group, whose ranks hold the same block inputs; none with
    Megatron sequence parallelism, where each holds its own slice already."""
    if not cfg.activation_checkpointing.partition_activations or groups.tensor.world_size == 1:
        return None
    if cfg.tensor_parallel is not None and cfg.tensor_parallel.sequence_parallel:
        log.info(
            "config: activation_checkpointing.partition_activations has no effect with "
            "tensor_parallel.sequence_parallel: each tensor rank keeps only its slice of the "
            "sequence already"
        )
        return None
    return groups.tensor


def _check_not_wrapped(model: nn.Module) -> None:
    """A parameter that is a view of a larger tensor is already inside an engine's buffer."""
    for name, param in model.named_parameters():
        if param.requires_grad and param.untyped_storage().nbytes() > param.nbytes:
            raise ValueError(
                f"parameter '{name}' shares its storage with a larger tensor: the model is "
                "already wrapped by a zerotrain engine (call engine.destroy() first), or the "
                "parameter is a view of another tensor, which zerotrain cannot repack"
            )


def _setup_activation_checkpointing(
    model: nn.Module,
    policy: ActivationCheckpointingPolicy | None,
    device: torch.device,
    partition_group: Communicator | None,
) -> tuple[checkpointing.CheckpointingContext, bool]:
    """Apply the config's ``activation_checkpointing``; returns the engine's checkpointing
    context and whether blocks were wrapped. ``partition_group``: the tensor group whose
    ranks hold the same block inputs (None: there is none)."""
    if policy is None:
        # The section is absent: share the process default (what checkpointing.configure()
        # sets by hand).
        return checkpointing.default_context(), False
    context = checkpointing.CheckpointingContext(policy, partition_group)
    if policy.cpu_checkpointing and device.type == "cpu":
        log.info(
            "config: activation_checkpointing.cpu_checkpointing has no effect: the device is "
            "the CPU, where checkpoint inputs live already"
        )
    if policy.block_types is None:
        return context, False
    checkpointing.apply(model, policy.block_types)
    return context, True


@dataclass
class _Grid:
    """What the steps after ``apply_grid`` share: the job, its groups and its policies."""

    cfg: ZeroTrainConfig
    env: DistEnv
    world: Communicator
    topology: Topology
    groups: ProcessGroups
    comm: Communicator  # ZeRO shards and reduces over data x sequence
    policies: Policies
    zero: ZeroPolicy
    pipe_module: PipelineModule | None
    schedule: PipelineSchedule | None
    telemetry: TelemetryPolicy


@dataclass
class _Prepared:
    """The model after ``apply_model``: on its device, identical across replicas, split."""

    values: DeferredValues | None  # zero.Init's recipe, for stage 3 to materialize by unit
    tensor_whole: list[nn.Parameter] | None  # whole on every tensor rank (norm counted once)
    checkpoint_context: checkpointing.CheckpointingContext
    wrapped_blocks: bool
    ties: list[Any]
    efficiency: Any  # progressive layer drop and curricula (engine.efficiency)


@dataclass
class _Zero:
    """What ``apply_zero`` built: the strategy, its offload manager, the estimate to log."""

    strategy: ZeroStrategy
    offload: Offload | None
    estimate: MemoryEstimate | None  # None unless training.log_memory asked for it


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
    *,
    topology: Topology | None = None,
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
        topology: the rank grid (default: the config's ``pipeline.stages``,
            ``tensor_parallel.autotp_size`` and ``sequence_parallel_size``, data parallelism
            over the rest). A tensor axis above 1 splits the model with the config's
            ``tensor_parallel`` plan or the model's own ``_tp_plan``; a model with neither
            runs replicated compute on that axis (logged): its ranks hold the same model and
            data. ZeRO shards over the data (x sequence) axis only.

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
    lr_find = LRFindRequest.from_env()  # `zerotrain lr-find` replaces the schedule
    source = _config_from_args(config, config_params, args)
    cfg = load_config(lr_find.override(source, lr_scheduler) if lr_find else source)
    _refuse_unimplemented(cfg)
    grid = apply_grid(cfg, model, topology)
    prepared = apply_model(model, grid)
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator must be read only once
        if optimizer is not None and not callable(optimizer):
            log.warning(
                "model_parameters is ignored: the optimizer passed to initialize "
                "already defines its parameter groups"
            )
    user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    param_groups = resolve_param_groups(model, model_parameters, user_optimizer)
    built = apply_zero(model, grid, prepared, param_groups)
    strategy = built.strategy
    spec = grid.policies.optimizer
    opt = make_optimizer(optimizer, spec, strategy, param_groups, model_parameters)
    scheduler = make_scheduler(lr_scheduler, grid.policies.scheduler, opt.optimizer)
    engine = apply_engine(model, grid, prepared, built, opt, scheduler)
    engine.training_dataloader = _data_loader(training_data, collate_fn, grid)
    # DeepSpeed's engine.config: the config as passed (a path is read, so always a dict).
    engine.config = (
        dict(source)
        if isinstance(source, dict)
        else cfg.model_dump(mode="json", by_alias=True, exclude_unset=True)
    )
    if lr_find is not None:
        engine.lr_find = LRRangeRecorder(lr_find, engine)
    _log_summary(grid, strategy)
    return engine, opt.optimizer, engine.training_dataloader, scheduler


def apply_grid(cfg: ZeroTrainConfig, model: nn.Module, topology: Topology | None) -> _Grid:
    """Join the job, check every rank has the same config, build the rank grid and its
    groups, the policies, the pipeline's schedule and the logging; refuse precisions the
    device or the pipeline cannot run."""
    env = init_distributed()
    world = Communicator(timeout=env.timeout, device=env.device)
    _check_same_config(world, cfg)
    topology = _resolve_topology(topology, cfg, env.world_size, model)
    groups = ProcessGroups.build(topology, world)
    policies = to_policies(cfg, groups.data.world_size)
    pipe_module = model if isinstance(model, PipelineModule) else None
    # A pipeline's schedule and checks come first: a refusal must not leave hooks behind.
    schedule = prepare_pipeline(pipe_module, cfg, policies) if pipe_module else None
    telemetry = telemetry_policy(cfg)
    for member in groups.distinct():
        member.configure_logger(telemetry.comms)
    comm_public.use_logger_policy(telemetry.comms)  # scripts' zerotrain.comm calls too
    for note in (*cfg.auto_notes, *inert_keys(cfg)):
        log.info("config: %s", note)
    for warning in ignored_keys(cfg):
        log.warning("config: %s", warning)
    precision = policies.precision
    if precision.autocast is not None and pipe_module is not None:
        raise NotImplementedError(
            "torch_autocast with a PipelineModule: the pipeline's stages do not run their "
            "forward under autocast yet; use the bf16 section"
        )
    if precision.compute is not None:
        check_device_supports(precision.compute, env.device)
    zero = ZeroPolicy.for_stage(policies.training.stage)
    return _Grid(
        cfg, env, world, topology, groups, groups.zero, policies, zero, pipe_module, schedule,
        telemetry,
    )  # fmt: skip


def apply_model(model: nn.Module, grid: _Grid) -> _Prepared:
    """Check every rank built the same model, apply sparse attention and training
    efficiency, place the model on its device with the same values on every replica, split
    it over the tensor axis, route attention over the sequence axis and wrap blocks for
    activation checkpointing."""
    cfg, groups, comm = grid.cfg, grid.groups, grid.comm
    # Every rank of a stage must hold the same layers (pipeline stages differ).
    _check_same_model(comm if grid.pipe_module is not None else grid.world, model, grid.world)
    if cfg.sparse_attention is not None:
        setup_sparse_attention(model, cfg.sparse_attention, groups)
    batch = grid.policies.training.batch
    efficiency = setup_training_efficiency(model, cfg, groups, batch.train_batch_size)
    plan = _tensor_parallel_plan(cfg, model, groups)
    values = _place(model, grid, keep_whole=not grid.zero.shard_parameters or plan is not None)
    tensor_whole: list[nn.Parameter] | None = None
    if plan is not None:
        # Split before blocks are wrapped for checkpointing: the plan names modules by path.
        tensor_whole = split_model(model, cfg, groups, *plan, grid.env.device)
    if groups.sequence.world_size > 1:
        log.info("Ulysses: attention routed through %s", route_attention(model, groups.sequence))
        distinct_random_streams(groups, grid.env.device)
    context, wrapped = _setup_activation_checkpointing(
        model,
        grid.policies.activation_checkpointing,
        grid.env.device,
        _partition_group(cfg, groups),
    )
    # Copies of a tied module on several stages start from the lowest stage's values.
    ties = tied_groups(grid.world, grid.pipe_module) if grid.pipe_module is not None else []
    return _Prepared(values, tensor_whole, context, wrapped, ties, efficiency)


def _place(model: nn.Module, grid: _Grid, keep_whole: bool) -> DeferredValues | None:
    """Move the model to its device and give every replica rank 0's values. Returns
    zero.Init's recipe when stage 3 materializes the parameters unit by unit (None when
    the model is whole: built eagerly, or ``keep_whole``)."""
    groups = grid.groups
    # The ranks that start from the same values: every ZeRO replica and every rank of a
    # tensor group (which then keeps its slices, or replicates compute without a plan).
    replicas = [grid.comm, *([groups.tensor] if groups.tensor.world_size > 1 else [])]
    values = deferred_values(model)
    if values is not None:
        # zero.Init recorded each rank's own random draws: compute rank 0's values on all.
        values.share_random_state(replicas)
    if values is not None and keep_whole:
        # Built by zero.Init, trained at a stage that keeps it whole, or about to be cut
        # into tensor-parallel slices (which needs the values: each rank keeps its own).
        materialize(model, values)
        values = None
    if values is None:
        model.to(grid.env.device)
    else:
        for tensor in [*model.buffers(), *(p for p in model.parameters() if not p.is_meta)]:
            tensor.data = tensor.data.to(grid.env.device)
    _check_not_wrapped(model)
    with torch.no_grad():
        # Parameters from zero.Init need no broadcast: every rank replays rank 0's recipe.
        # A model about to be split is whole here: its tensor group takes rank 0's values.
        params = [p.data for p in model.parameters() if not p.is_meta]
        state = params + list(model.buffers())
        for replica in replicas:
            broadcast_tensors(replica, state, _INIT_BUCKET_NUMEL, src=0)
    return values


def apply_zero(
    model: nn.Module, grid: _Grid, prepared: _Prepared, param_groups: ParamGroups
) -> _Zero:
    """Pack the parameters into units and hook gradient reduction (the ZeRO strategy), with
    the offload manager it needs, and the memory estimate to log (None unless asked), made
    before the parameters are repacked."""
    policies, zero, comm = grid.policies, grid.zero, grid.comm
    estimate = None
    if policies.training.log_memory:
        estimate = predict_memory(model, policies, comm.rank, comm.world_size, grid.env.device)
    offload = None
    if policies.offload.enabled and zero.shard_optimizer:
        offload = Offload(
            policies.offload,
            comm,
            zero.shard_parameters,
            policies.stage3.persistence_threshold,
            shard_gradients=zero.shard_gradients,
        )
    pad_multiple = 1
    spec = policies.optimizer
    if spec is not None and is_compressed(spec):
        # (Offload with them is refused with the config: it steps Adam/AdamW only.)
        pad_multiple = check_compressed(spec, zero.stage, grid.topology, comm.world_size)
    whole = prepared.tensor_whole
    stage3 = (
        Stage3Options(model, policies.stage3, prepared.values) if zero.shard_parameters else None
    )
    try:
        strategy = ZeroStrategy(
            param_groups.trainable,
            len(list(model.parameters())),
            policies.grad_reduce.bucket_numel,
            comm,
            zero,
            policies.grad_reduce,
            stage3,
            policies.precision,
            offload,
            # Pipeline stages hold different parameters, tensor ranks different slices.
            distinct_axes=[grid.groups.pipe, *([grid.groups.tensor] if whole is not None else [])],
            isolate=grid.pipe_module.tied_prefixes() if grid.pipe_module is not None else (),
            pad_multiple=pad_multiple,
        )
        if whole is not None and grid.groups.tensor.rank != 0:
            # Whole on every tensor rank, with the same gradients: the first rank counts them.
            strategy.count_once_elsewhere(whole)
    except BaseException:
        if offload is not None:
            offload.close()  # its swap files and allocator setting; no engine will
        raise
    return _Zero(strategy, offload, estimate)


def apply_engine(
    model: nn.Module,
    grid: _Grid,
    prepared: _Prepared,
    built: _Zero,
    opt: EngineOptimizer,
    scheduler: Any,
) -> Engine:
    """The engine over everything built so far (``built``: what ``apply_zero`` returned):
    a PipelineEngine for a PipelineModule."""
    strategy, offload, estimate = built.strategy, built.offload, built.estimate
    policies = grid.policies
    engine_args = [model, grid.env, grid.comm, policies.training, strategy, opt, scheduler]
    engine_args += [policies.precision, grid.telemetry, estimate]
    if grid.pipe_module is not None and grid.schedule is not None:
        check_tied_units(strategy, prepared.ties, grid.world)
        engine: Engine = PipelineEngine(
            *engine_args,
            groups=grid.groups,
            pipeline=policies.pipeline,
            schedule=grid.schedule,
            ties=prepared.ties,
        )
        log.info(
            "pipeline: %s schedule; partition:\n%s",
            grid.schedule.name,
            grid.pipe_module.describe_partition(),
        )
    else:
        engine = Engine(*engine_args, groups=grid.groups)
    # Sequence-parallel whole parameters: one coalesced sum per step on the reduced
    # gradients instead of one all-reduce per parameter per backward. Last, so that a
    # failure before it leaves parallelize's hooks in place. Not with gradients in swap
    # files, nor with the 1-bit optimizers (their windows keep each rank's own gradients):
    # their hooks stay.
    streamed = offload is not None and offload.swap_grads
    spec = policies.optimizer
    if not streamed and not (spec is not None and is_compressed(spec)):
        take_over_sequence_parallel_sums(model, strategy)
    if grid.cfg.gradient_accumulation_fusion:
        strategy.fuse_weight_grads(model)
    engine.checkpointed_blocks = prepared.wrapped_blocks
    engine.efficiency = prepared.efficiency
    engine.activation_checkpointing = prepared.checkpoint_context
    return engine


def _data_loader(
    training_data: Dataset[Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    grid: _Grid,
) -> DistributedDataLoader | None:
    """A loader of this data-parallel rank's samples of ``training_data`` (None without)."""
    if training_data is None:
        return None
    training = grid.policies.training
    return DistributedDataLoader(
        training_data,
        training.batch.micro_batch_size,
        grid.groups.data.rank,
        grid.groups.data.world_size,
        collate_fn=collate_fn,
        drop_last=training.drop_last,
        pin_memory=grid.env.device.type == "cuda",
    )


def _log_summary(grid: _Grid, strategy: ZeroStrategy) -> None:
    precision, batch = grid.policies.precision, grid.policies.training.batch
    log.info(
        "initialized: ZeRO stage %d, %s, %d rank(s) (%s), %d parameters in %d unit(s), "
        "batch %d = %d micro x %d accumulation x %d data-parallel ranks",
        grid.zero.stage,
        "the model's own dtype"
        if precision.compute is None
        else f"{precision.compute} with fp32 master weights",
        grid.world.world_size,
        grid.topology,
        sum(u.numel for u in strategy.units),
        len(strategy.units),
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
        batch.dp_world_size,
    )


def take_over_sequence_parallel_sums(model: nn.Module, strategy: ZeroStrategy) -> None:
    """Move the per-parameter gradient sums ``parallelize`` hooked on sequence-parallel
    LayerNorms and row biases to the strategy, which makes one all-reduce of all of them
    per optimizer step (review 2026-11-28, T3). Collective over each tensor group."""
    taken = take_over_gradient_sums(model.parameters())
    try:
        for comm, params in taken.items():
            strategy.sum_over_group_each_step(params, comm)
    except BaseException:
        restore_gradient_sums(taken)
        raise

"""The validated config turned into small frozen dataclasses, one per component.

Components below ``config`` receive only their own policy (never the whole config), so the
coupling between a component and the config keys it reads is visible in its signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from zerotrain.config import optim_params
from zerotrain.config.batch import BatchSizes, resolve_batch_sizes
from zerotrain.config.elasticity import elastic_batch_sizes
from zerotrain.config.errors import ConfigError, ConfigProblem
from zerotrain.config.schema import ZeroTrainConfig

DTYPE_BY_NAME = MappingProxyType(
    {
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "bf16": torch.bfloat16,
        "bfp16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
)


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
class LossScalePolicy:
    """fp16 loss scaling (DeepSpeed's ``fp16`` keys); ``static_scale`` None = dynamic."""

    static_scale: float | None
    initial_scale: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """Dtypes of one training run.

    ``compute``: parameters, activations and gradients in forward/backward (None: whatever
    the model is in, no conversion). When set, the optimizer updates fp32 master copies of
    the parameters. ``grad_accum``: the buffer gradients are summed into across micro-steps
    (None: fp32 under mixed precision, else the parameters' dtype); ``comm``: the dtype
    gradients are reduced in (None: the same default). ``check_overflow``: skip a step whose
    gradients hold inf/NaN (always with fp16). ``cast_inputs``: cast floating-point inputs
    of the forward pass to ``compute``.
    """

    compute: torch.dtype | None = None
    grad_accum: torch.dtype | None = None
    comm: torch.dtype | None = None
    loss_scale: LossScalePolicy | None = None
    check_overflow: bool = False
    cast_inputs: bool = True
    autocast: torch.dtype | None = None  # torch_autocast: forward under torch.autocast

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """What the forward runs inside: ``torch.autocast`` with ``torch_autocast``, else
        nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 copies rather than the parameters themselves."""
        return self.compute is not None

    def resolve(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """``(compute, accumulation, communication)`` dtypes for parameters that the model
        holds in ``model_dtype``.

        Raises:
            ConfigError: an accumulation dtype other than the parameters' own without master
                weights (the optimizer would step the parameters with gradients it cannot
                hold as their ``.grad``).
        """
        compute = self.compute or model_dtype
        default = torch.float32 if self.master_weights else model_dtype
        if not self.master_weights and self.grad_accum not in (None, model_dtype):
            name = short_dtype_name(model_dtype)
            raise ConfigError(
                [
                    ConfigProblem(
                        "data_types.grad_accum_dtype",
                        f"got {short_dtype_name(self.grad_accum)}, but the model's parameters "
                        f"are {name} and neither bf16 nor fp16 is enabled, so gradients "
                        f"accumulate in {name}; enable bf16/fp16 (fp32 master weights) to "
                        "accumulate in another dtype, or remove the key",
                    )
                ]
            )
        return compute, self.grad_accum or default, self.comm or default


@dataclass(frozen=True, slots=True)
class TrainingPolicy:
    """Step-level settings the engine reads."""

    batch: BatchSizes
    stage: int
    clip_norm: float
    steps_per_print: int
    log_memory: bool
    drop_last: bool
    # The loss is divided by this before backward; under mixed precision averaging over
    # micro-steps happens in the fp32 reduction instead (1/3 is not exact in bf16).
    loss_divisor: int = 1
    # save_16bit_model at stage 3 gathers the weights (else it writes nothing, as DeepSpeed).
    gather_16bit_on_save: bool = False
    # Checkpoints: how many to keep (None: all) and what to do when ranks pass different
    # tags ("fail", "warn" or "ignore").
    keep_last: int | None = None
    # fp32/bf16 steps with inf/NaN gradients: "skip", "raise" or "ignore", and how many
    # skipped steps in a row raise.
    non_finite_action: str = "skip"
    max_consecutive_skips: int = 10
    tag_validation: str = "warn"


@dataclass(frozen=True, slots=True)
class ActivationCheckpointingPolicy:
    """How ``zerotrain.checkpointing.checkpoint`` keeps and recomputes activations.

    ``cpu_checkpointing``: the saved inputs of each checkpoint live in host memory (pinned,
    copied asynchronously) while the device is an accelerator. ``contiguous_memory``: they
    are copied into one preallocated buffer reused every step (``number_checkpoints`` sizes
    it; it grows to what a step needs otherwise). ``synchronize``: the device is
    synchronized at each checkpoint boundary. ``profile``: forward and recomputation times
    and the bytes kept are counted. ``partition_activations`` splits the saved inputs over
    the tensor-parallel group, a no-op without tensor parallelism. ``block_types``: class
    names, or "auto", of the blocks ``initialize`` checkpoints (None: only explicit calls).
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False
    block_types: tuple[str, ...] | str | None = None


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """Where optimizer states and (stage 3) parameter shards live between uses.

    ``optimizer`` / ``param``: "none", "cpu" or "nvme". NVMe offload keeps them in files
    under the ``*_nvme_path`` directories, streamed through ``*_buffer_count`` buffers of
    ``chunk_numel`` elements by ``io_threads`` threads issuing ``io_block_bytes`` requests.
    ``max_in_cpu``: stage-3 parameter elements kept in memory (not swapped) under NVMe
    parameter offload, taken by the units built first. ``pin_memory``: page-locked host
    buffers (faster device transfers on CUDA).
    """

    optimizer: str = "none"
    param: str = "none"
    optimizer_nvme_path: str | None = None
    param_nvme_path: str | None = None
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    chunk_numel: int = 1 << 22
    io_threads: int = 2
    io_block_bytes: int = 8 << 20

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.param != "none"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer, self.param)


@dataclass(frozen=True, slots=True)
class PipelinePolicy:
    """The ``pipeline`` section, resolved (the defaults when the config has none).

    ``stages``: pipeline ranks, None for ``"auto"`` (the PipelineModule's count).
    ``partition_method``: "parameters", "uniform" or "type:REGEX" (DeepSpeed's "best" becomes
    "parameters"). ``schedule``: "1f1b", "gpipe", "interleaved" or "zb-h1", with
    ``virtual_stages`` chunks per rank. ``grad_reduce``: "per_microbatch" or "end_of_step".
    ``reshard_after_forward`` (stage 3): release a stage's parameters after each
    micro-batch's forward. DeepSpeed's ``pipe_partitioned`` / ``grad_partitioned`` have no
    effect and are not carried.
    """

    stages: int | None = None
    partition_method: str = "parameters"
    seed_layers: bool = False
    activation_checkpoint_interval: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    grad_reduce: str = "end_of_step"
    reshard_after_forward: bool = True


@dataclass(frozen=True, slots=True)
class Policies:
    """Everything ``initialize`` needs from the config."""

    training: TrainingPolicy
    grad_reduce: GradReducePolicy
    stage3: Stage3Policy
    precision: PrecisionPolicy
    optimizer: OptimizerSpec | None
    scheduler: SchedulerSpec | None
    activation_checkpointing: ActivationCheckpointingPolicy | None = None
    offload: OffloadPolicy = OffloadPolicy()
    pipeline: PipelinePolicy = PipelinePolicy()


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
    if cfg.elasticity is not None and cfg.elasticity.enabled:
        given = {
            "train_batch_size": cfg.train_batch_size,
            "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        }
        batch = elastic_batch_sizes(cfg.elasticity, given, dp_world_size)
    else:
        batch = resolve_batch_sizes(
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
            dp_world_size,
        )
    zero = cfg.zero_optimization
    precision = resolve_precision(cfg)
    if cfg.prescale_gradients:
        pre, post = float(dp_world_size), 1.0
    else:
        pre = cfg.gradient_predivide_factor
        post = dp_world_size / cfg.gradient_predivide_factor
    gas = batch.gradient_accumulation_steps
    if precision.master_weights:
        post *= gas  # see TrainingPolicy.loss_divisor
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
        loss_divisor=1 if precision.master_weights else gas,
        gather_16bit_on_save=zero.stage3_gather_16bit_weights_on_model_save,
        keep_last=cfg.checkpoint.keep_last,
        tag_validation=cfg.checkpoint.tag_validation.lower(),
        non_finite_action=cfg.non_finite_gradients.action,
        max_consecutive_skips=cfg.non_finite_gradients.max_consecutive_skips,
    )
    optimizer = scheduler = None
    if cfg.optimizer is not None:
        optimizer = OptimizerSpec(*_spec("optimizer", cfg.optimizer.type, cfg.optimizer.params))
    if cfg.scheduler is not None:
        scheduler = SchedulerSpec(*_spec("scheduler", cfg.scheduler.type, cfg.scheduler.params))
    return Policies(
        training,
        grad_reduce,
        stage3,
        precision,
        optimizer,
        scheduler,
        activation_checkpointing_policy(cfg),
        offload_policy(cfg),
        pipeline_policy(cfg),
    )


def pipeline_policy(cfg: ZeroTrainConfig) -> PipelinePolicy:
    """The ``pipeline`` section with ``"auto"`` and ``"best"`` resolved."""
    pipe = cfg.pipeline
    if pipe is None:
        return PipelinePolicy()
    partition = pipe.partition
    if partition.lower() in ("best", "parameters", "uniform"):
        partition = "parameters" if partition.lower() == "best" else partition.lower()
    else:  # "type:REGEX": the prefix is case-insensitive, the regex is kept as written
        partition = "type:" + partition[len("type:") :]
    return PipelinePolicy(
        stages=None if pipe.stages == "auto" else pipe.stages,
        partition_method=partition,
        seed_layers=pipe.seed_layers,
        activation_checkpoint_interval=pipe.activation_checkpoint_interval,
        schedule=pipe.schedule,
        virtual_stages=pipe.virtual_stages,
        grad_reduce=pipe.grad_reduce,
        reshard_after_forward=pipe.reshard_after_forward,
    )


def offload_policy(cfg: ZeroTrainConfig) -> OffloadPolicy:
    """The ``offload_optimizer`` / ``offload_param`` sections and the ``aio`` tuning."""
    zero = cfg.zero_optimization
    opt, param = zero.offload_optimizer, zero.offload_param
    return OffloadPolicy(
        optimizer=opt.device,
        param=param.device,
        optimizer_nvme_path=opt.nvme_path,
        param_nvme_path=param.nvme_path,
        optimizer_buffer_count=opt.buffer_count,
        param_buffer_count=param.buffer_count,
        max_in_cpu=param.max_in_cpu,
        pin_memory=opt.pin_memory or param.pin_memory,
        io_threads=max(2, cfg.aio.thread_count),
        io_block_bytes=max(1 << 20, cfg.aio.block_size),
    )


def activation_checkpointing_policy(cfg: ZeroTrainConfig) -> ActivationCheckpointingPolicy | None:
    """The ``activation_checkpointing`` section, or None when the config does not set it
    (``initialize`` then leaves whatever ``zerotrain.checkpointing.configure`` set)."""
    ac = cfg.activation_checkpointing
    if not ac.model_fields_set:
        return None
    blocks = ac.block_types
    return ActivationCheckpointingPolicy(
        partition_activations=ac.partition_activations,
        cpu_checkpointing=ac.cpu_checkpointing,
        contiguous_memory=ac.contiguous_memory_optimization,
        number_checkpoints=ac.number_checkpoints,
        synchronize=ac.synchronize_checkpoint_boundary,
        profile=ac.profile,
        block_types=tuple(blocks) if isinstance(blocks, list) else blocks,
    )


def resolve_precision(cfg: ZeroTrainConfig) -> PrecisionPolicy:
    """The dtypes the config asks for.

    Raises:
        ConfigError: fp16 and bf16 both enabled, or an accumulation dtype that is neither
            fp32 nor the compute dtype.
    """
    problems: list[ConfigProblem] = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.append(
            ConfigProblem("fp16.enabled", "fp16 and bf16 are both enabled; enable at most one")
        )
    autocast = cfg.torch_autocast is not None and cfg.torch_autocast.enabled
    if autocast and (cfg.fp16.enabled or cfg.bf16.enabled):
        problems.append(
            ConfigProblem(
                "torch_autocast.enabled",
                "torch_autocast keeps fp32 parameters and cannot be combined with the fp16 or "
                "bf16 sections (DeepSpeed refuses it too); enable one of them",
            )
        )
    compute = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    accum = None
    name = cfg.data_types.grad_accum_dtype
    if name is not None:
        accum = DTYPE_BY_NAME[name]
        allowed = (torch.float32, compute)
        if accum not in allowed:
            spelled = " or ".join(short_dtype_name(d) for d in allowed if d is not None)
            needs = "" if compute is not None else " (bf16/fp16 need bf16.enabled/fp16.enabled)"
            problems.append(
                ConfigProblem(
                    "data_types.grad_accum_dtype",
                    f"got {name!r}, but the model computes in "
                    f"{short_dtype_name(compute or torch.float32)}; allowed: {spelled}{needs}",
                )
            )
    comm = DTYPE_BY_NAME[cfg.communication_data_type] if cfg.communication_data_type else None
    if comm == torch.float16 and compute != torch.float16:
        # Without a loss scale small gradients flush to zero in fp16 and large ones become
        # inf, which nothing would catch.
        problems.append(
            ConfigProblem(
                "communication_data_type",
                f"got {cfg.communication_data_type!r}, which needs fp16.enabled (fp16 holds "
                "gradients only under a loss scale); allowed here: fp32 or bf16",
            )
        )
    if problems:
        raise ConfigError(problems)
    scaling = None
    if cfg.fp16.enabled:
        fp16 = cfg.fp16
        scaling = LossScalePolicy(
            static_scale=fp16.loss_scale if fp16.loss_scale > 0 else None,
            initial_scale=2.0**fp16.initial_scale_power,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )
    return PrecisionPolicy(
        compute=compute,
        grad_accum=accum,
        comm=comm,
        loss_scale=scaling,
        check_overflow=cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow),
        cast_inputs=cfg.fp16.auto_cast if cfg.fp16.enabled else cfg.bf16.auto_cast,
        autocast=torch.bfloat16 if autocast else None,
    )


def short_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``, as configs write it."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return short.get(dtype, str(dtype).removeprefix("torch."))

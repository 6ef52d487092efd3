"""The typed config schema, with DeepSpeed's key names so existing JSON configs load unchanged.

Each section documents its keys. Sections for features zerotrain does not implement yet are
part of the schema (a config that mentions them is valid); ``features.py`` decides whether an
enabled feature is usable and says so clearly when it is not.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from zerotrain.config.efficiency import (
    CurriculumLearningConfig,
    DataEfficiencyConfig,
    ProgressiveLayerDropConfig,
)
from zerotrain.config.elasticity import ElasticityConfig
from zerotrain.config.types import (
    Bool,
    Float,
    Int,
    LooseSection,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitFraction,
)

DTypeName = Literal["fp32", "fp16", "bf16", "bfp16", "float32", "float16", "bfloat16"]


class OptimizerConfig(Section):
    """``optimizer``: which optimizer the engine builds and its hyperparameters.

    ``params`` is checked against the chosen ``type`` by ``optim_params.py`` (the set of valid
    keys depends on the type).
    """

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    # DeepSpeed's switch for its old fused-optimizer wrapper; no effect here (warned).
    legacy_fusion: Bool | None = None


class SchedulerConfig(Section):
    """``scheduler``: learning-rate schedule stepped once per optimizer step."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class FP16Config(Section):
    """``fp16``: float16 compute with fp32 master weights and loss scaling."""

    enabled: Bool = False
    # Cast floating-point forward inputs to fp16 (DeepSpeed's default is false; zerotrain
    # casts unless told not to, as FSDP2 does).
    auto_cast: Bool = True
    loss_scale: NonNegativeFloat = 0.0  # 0 = dynamic scaling
    initial_scale_power: NonNegativeInt = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: PositiveFloat = 1.0
    fp16_master_weights_and_grads: Bool = False


class BF16Config(Section):
    """``bf16`` (legacy spelling ``bfloat16``): bfloat16 compute with fp32 master weights."""

    enabled: Bool = False
    auto_cast: Bool = True  # zerotrain key: cast floating-point forward inputs to bf16
    immediate_grad_update: Bool = False
    check_grad_overflow: Bool = False
    # DeepSpeed 0.17+: keep master weights and gradients (and optimizer states) in bf16 to
    # save memory. zerotrain keeps fp32 masters: refused when true (features.py).
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False
    # bf16 needs no loss scaling; old configs carry "loss_scale": 1.0, which is harmless.
    loss_scale: Float = 1.0

    @model_validator(mode="after")
    def _states_need_masters(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError(
                "bf16_optimizer_states needs bf16_master_weights_and_grads (as in DeepSpeed)"
            )
        return self

    @field_validator("loss_scale")
    @classmethod
    def _no_scaling(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("bf16 does not use loss scaling; only 1.0 is allowed")
        return value


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where master weights and optimizer states live."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: PositiveInt = 4
    pin_memory: Bool = False
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: UnitFraction = 1.0
    # DeepSpeed 0.18+: SuperOffload for Grace-Hopper-class superchips, and the share of CPU
    # cores its CPU Adam uses. Accepted; no effect here (a warning says so).
    super_offload: Bool = False
    cpuadam_cores_perc: Annotated[Float, Field(ge=0, le=1)] = 0.8


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param`` (stage 3): where parameter shards live between uses."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: PositiveInt = 5
    buffer_size: PositiveInt = 100_000_000
    max_in_cpu: NonNegativeInt = 1_000_000_000
    pin_memory: Bool = False


def _offload_section(value: Any) -> Any:
    # Some public configs write `"offload_param": false` where the docs expect an object.
    if value is False or value is None:
        return {"device": "none"}
    if value is True:
        raise ValueError('give an object such as {"device": "cpu"} instead of true')
    return value


class ZeroConfig(Section):
    """``zero_optimization``: which model states are partitioned across data-parallel ranks."""

    stage: Annotated[Int, Field(ge=0, le=3)] = 0
    overlap_comm: Bool | None = None  # None: on (reduce from backward hooks)
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    # Elements per communication bucket; 0 means one tensor per bucket (no batching). Unset:
    # sized from the model (see zero/units.py), so every model gets overlap and stage 2's
    # bounded gradient memory (DeepSpeed's 5e8 default puts most models in one bucket).
    reduce_bucket_size: NonNegativeInt | None = None
    allgather_partitions: Bool = True
    allgather_bucket_size: NonNegativeInt = 500_000_000
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    sub_group_size: PositiveInt = 1_000_000_000
    stage3_prefetch_bucket_size: NonNegativeInt = 50_000_000
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    stage3_max_live_parameters: NonNegativeInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    # zerotrain: class names of the modules that become stage-3 units (default: the
    # repeated blocks, e.g. the layers of a transformer).
    stage3_unit_classes: list[str] | None = None
    elastic_checkpoint: Bool = False
    round_robin_gradients: Bool = False
    ignore_unused_parameters: Bool = True
    load_from_fp32_weights: Bool = True
    legacy_stage1: Bool = False
    zero_hpz_partition_size: PositiveInt = 1
    zero_quantized_weights: Bool = False
    zero_quantized_gradients: Bool = False
    mics_shard_size: Int = -1
    memory_efficient_linear: Bool = True
    # DeepSpeed 0.18+: ZenFlow (stall-free offloading: top-k gradient columns stepped at
    # once, the rest later). Accepted; no effect here (a warning says so).
    zenflow: LooseSection | None = None
    # DeepSpeed 0.19 tuning knobs of its own implementation; accepted, no effect (noted by
    # features.py with what zerotrain does instead). Unprefixed spellings are renamed to the
    # stage3_ ones by legacy.py.
    use_multi_rank_bucket_allreduce: Bool = True
    stage3_model_persistence_threshold: NonNegativeInt | None = None  # DeepSpeed: sys.maxsize
    stage3_module_granularity_threshold: Int = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    stage3_allgather_sequential: Bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_hierarchical_params_gather: Bool = False
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LooseSection | None = None
    # ZeRO++ quantized frozen weights: refused when true, like zero_quantized_weights.
    zero_quantized_nontrainable_weights: Bool = False

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _offload_bool(cls, value: Any) -> Any:
        return _offload_section(value)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> ZeroConfig:
        for name in ("offload_optimizer", "offload_param"):
            section = getattr(self, name)
            if section.device == "nvme" and not section.nvme_path:
                raise ValueError(f'{name}.device is "nvme" but {name}.nvme_path is not set')
        return self


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: options for ``zerotrain.checkpointing.checkpoint``
    (see docs/activation_checkpointing.md)."""

    partition_activations: Bool = False
    cpu_checkpointing: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: PositiveInt | None = None
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False
    # zerotrain: checkpoint every block of the model at initialize: class names, or "auto"
    # for the repeated blocks (the layers of a transformer). Unset: only explicit calls.
    block_types: list[str] | Literal["auto"] | None = None


class FlopsProfilerConfig(Section):
    """``flops_profiler``: per-module FLOPs and latency for one step."""

    enabled: Bool = False
    recompute_fwd_factor: NonNegativeFloat = 0.0
    profile_step: Int = 1
    module_depth: Int = -1
    top_modules: PositiveInt = 1
    detailed: Bool = True
    output_file: str | None = None


class MonitorConfig(Section):
    """``tensorboard`` / ``csv_monitor``: scalar logs written on rank 0."""

    enabled: Bool = False
    output_path: str = ""
    job_name: str = "zerotrain_job"


class WandbConfig(Section):
    """``wandb``: Weights & Biases logging on rank 0."""

    enabled: Bool = False
    group: str | None = None
    team: str | None = None
    project: str = "zerotrain"


class CommsLoggerConfig(Section):
    """``comms_logger``: per-collective counts, sizes, latencies and bandwidth."""

    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    debug: Bool = False
    prof_ops: list[str] = Field(default_factory=list)


class DataTypesConfig(Section):
    """``data_types``: dtype of the gradient accumulation buffer."""

    grad_accum_dtype: DTypeName | None = None
    # DeepSpeed 0.19: a check of the parameter dtype against fp16/bf16, and a dtype for
    # buffers. No effect here (warned): the precision sections set both.
    param_dtype: DTypeName | None = None
    buffer_dtype: DTypeName | None = None


class AioConfig(Section):
    """``aio``: asynchronous NVMe I/O tuning (used by NVMe offload)."""

    block_size: PositiveInt = 1_048_576
    queue_depth: PositiveInt = 8
    thread_count: PositiveInt = 1
    single_submit: Bool = False
    overlap_events: Bool = True
    use_gds: Bool = False
    intra_op_parallelism: PositiveInt = 1


class CheckpointConfig(Section):
    """``checkpoint``: checkpoint loading and writing options."""

    tag_validation: Literal["Ignore", "Warn", "Fail", "ignore", "warn", "fail"] = "Warn"
    # zerotrain: keep only the newest N complete checkpoints in the save directory.
    keep_last: PositiveInt | None = None
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: dict[str, Any] = Field(default_factory=dict)
    # DeepSpeed's torch.save serialization switch and FastPersist writer; zerotrain writes
    # its own files, so both have no effect (warned).
    checkpoint_serialization: Bool = True
    writer: dict[str, Any] | None = None


PARTITION_METHODS = ("parameters", "uniform", "type:REGEX", "best")


class TensorParallelLayerSpec(Section):
    """One entry of ``tensor_parallel.partition_config.layer_specs`` (DeepSpeed AutoTP)."""

    # Regular expressions matched (re.match) against parameter names such as
    # "model.layers.0.self_attn.q_proj.weight"; the Linear owning the parameter is split.
    patterns: list[str]
    partition_type: Literal["column", "row", "skip"] = "column"
    # Packed projections along the output: [N, -1] (N equal parts) or [[A, B, C], -1].
    shape: list[Any] | None = None
    partition_dim: NonNegativeInt | None = None
    gather_output: Bool = False
    model_types: list[str] | None = None

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class TensorParallelPartitionConfig(Section):
    """``tensor_parallel.partition_config``: DeepSpeed AutoTP's custom layer specs."""

    layer_specs: list[TensorParallelLayerSpec] = Field(default_factory=list)
    # Merge with the preset's specs (preset_model); the custom specs match first.
    use_default_specs: Bool = True
    # Every Linear must match a spec (a Linear left whole would be an error).
    strict_mode: Bool = False
    # DeepSpeed's AutoTPConfig keys that its training path never reads either (the degree
    # is autotp_size; embeddings and the output head stay whole): no effect, warned.
    tp_size: PositiveInt | None = None
    embedding_partition_dim: Int | None = None
    lm_head_patterns: list[str] | None = None


class TensorParallelConfig(Section):
    """``tensor_parallel``: tensor parallelism (DeepSpeed's AutoTP training keys, then
    zerotrain's ``plan`` and ``sequence_parallel``)."""

    # The tensor-parallel degree; the grid's tensor axis.
    autotp_size: PositiveInt = 1
    # A named layer layout (DeepSpeed's presets): "llama", "mistral", "qwen2", "gpt".
    preset_model: str | None = None
    partition_config: TensorParallelPartitionConfig | None = None
    # DeepSpeed keys with no effect here (logged): communication overlap and where the
    # unsplit model is kept while it is split.
    tp_overlap_comm: Bool = False
    keep_module_on_host: Bool = False
    # More DeepSpeed TPTrainingConfig keys: the dtype and inference-TP options its AutoTP
    # passes to module injection (no effect here, warned; "tensor_parallel" is renamed to
    # "tp" by legacy.py), and kernel injection (refused when true; alias "kernel_inject").
    dtype: str | None = None
    tp: dict[str, Any] | None = None
    injection_policy_tuple: Any = None
    replace_with_kernel_inject: Bool = False
    # zerotrain: {module-name glob: style} (see zerotrain.parallel.tensor.plan); default:
    # the model's own plan (a transformers model's _tp_plan) when no specs are given.
    plan: dict[str, str] | None = None
    # zerotrain: Megatron sequence parallelism between tensor-parallel blocks (the
    # model's blocks must be written for it; see docs/parallelism.md).
    sequence_parallel: Bool = False


class PipelineConfig(Section):
    """``pipeline``: pipeline parallelism over a ``zerotrain.pipe.PipelineModule``.

    DeepSpeed's keys first, then zerotrain's (``schedule`` onwards).
    """

    # Pipeline ranks; "auto": as many as the PipelineModule has (1 without one).
    stages: PositiveInt | Literal["auto"] = "auto"
    # How layers are cut into stages: "parameters" (balance trainable parameters),
    # "uniform" (balance layer counts) or "type:REGEX" (balance the layers whose class name
    # matches). "best", DeepSpeed's default spelling, is accepted as "parameters".
    partition: str = "parameters"
    # Seed each layer's construction with base_seed + its index (stage-independent values).
    seed_layers: Bool = False
    # Checkpoint activations every this many layers (0: no checkpointing).
    activation_checkpoint_interval: NonNegativeInt = 0
    # DeepSpeed's partitioning of activations/gradients sent between stages over the
    # tensor-parallel group: accepted for compatibility, no effect.
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    # DeepSpeed: reentrant activation checkpointing in the pipeline; zerotrain always
    # checkpoints without reentrancy (noted, no effect).
    use_reentrant: Bool = True
    # zerotrain: the order of micro-batch forwards and backwards.
    schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1"] = "1f1b"
    # zerotrain: layer chunks per rank; above 1 needs schedule "interleaved".
    virtual_stages: PositiveInt = 1
    # zerotrain: reduce a stage's gradients across data-parallel ranks after each
    # micro-batch's backward ("per_microbatch", overlapping the schedule) or once at the
    # end of the step ("end_of_step", fewer and larger reductions).
    grad_reduce: Literal["per_microbatch", "end_of_step"] = "end_of_step"
    # zerotrain, ZeRO stage 3: release a stage's parameters after each micro-batch's forward
    # and gather them again for its backward (less memory), or keep them gathered for the
    # whole step (fewer all-gathers).
    reshard_after_forward: Bool = True

    @field_validator("stages", mode="plain")
    @classmethod
    def _stages(cls, value: Any) -> int | str:
        # One message for the int-or-"auto" union instead of one per alternative.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value == "auto" or (
            not isinstance(value, bool) and isinstance(value, int) and value >= 1
        ):
            return value
        raise ValueError('allowed: a whole number >= 1, or "auto" (the PipelineModule\'s count)')

    @field_validator("partition")
    @classmethod
    def _known_partition(cls, value: str) -> str:
        lowered = value.lower()
        if lowered in ("parameters", "uniform", "best"):
            return value
        if lowered.startswith("type:") and value[len("type:") :]:
            try:
                re.compile(value[len("type:") :])
            except re.error as err:
                raise ValueError(f"invalid regex after 'type:' ({err})") from None
            return value
        raise ValueError(f"allowed: {', '.join(PARTITION_METHODS)}")

    @model_validator(mode="after")
    def _virtual_needs_interleaving(self) -> PipelineConfig:
        if (self.virtual_stages > 1) != (self.schedule == "interleaved"):
            raise ValueError(
                f"schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: "
                'virtual_stages above 1 needs schedule "interleaved", and "interleaved" '
                "needs virtual_stages >= 2"
            )
        return self


class NonFiniteGradientsConfig(Section):
    """``non_finite_gradients`` (zerotrain's; DeepSpeed has none): what a step whose
    gradients hold inf/NaN does without fp16's loss scaler (fp32, bf16). ``action``:
    ``"skip"`` the update on every rank (logged with the step and the first non-finite
    parameter, counted in ``skipped_steps``), ``"raise"`` at once (Megatron's choice), or
    ``"ignore"`` (apply it: parameters become NaN; no per-step synchronization).
    ``max_consecutive_skips``: raise when this many steps in a row were skipped."""

    action: Literal["skip", "raise", "ignore"] = "skip"
    max_consecutive_skips: PositiveInt = 10


class SparseAttentionConfig(Section):
    """``sparse_attention``: DeepSpeed's block-sparse layout keys (see
    docs/sparse_attention.md). Defaults are DeepSpeed's; ``attention`` and the mode-specific
    ``num_random_blocks`` default per mode (None here). zerotrain adds ``seed`` (random
    blocks; every rank builds the same layout), ``kernel`` (``auto``, ``blocked``,
    ``flex``) and ``max_seq_length`` (default: the model's), and the ``local`` mode
    (DeepSpeed's LocalSlidingWindowSparsityConfig).
    Combinations (``num_local_blocks`` divisible by ``num_global_blocks``, ...) are checked by
    the layout classes when ``initialize`` applies the section (config imports no layer)."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer", "local"] = "fixed"
    block: PositiveInt = 16
    different_layout_per_head: Bool = False
    num_local_blocks: PositiveInt | None = None
    num_global_blocks: PositiveInt | None = None
    attention: Literal["unidirectional", "bidirectional"] | None = None
    horizontal_global_attention: Bool | None = None
    num_different_global_patterns: PositiveInt | None = None
    num_random_blocks: NonNegativeInt | None = None
    local_window_blocks: list[PositiveInt] | None = None
    global_block_indices: list[NonNegativeInt] | None = None
    global_block_end_indices: list[NonNegativeInt] | None = None
    num_sliding_window_blocks: PositiveInt | None = None
    seed: NonNegativeInt = 0
    kernel: Literal["auto", "blocked", "flex"] = "auto"
    max_seq_length: PositiveInt | None = None


class TorchAutocastConfig(Section):
    """``torch_autocast`` (DeepSpeed 0.16+): forward under ``torch.autocast`` with fp32
    parameters and optimizer, instead of the ``bf16``/``fp16`` sections' low-precision
    parameters. zerotrain runs ``bfloat16``; ``lower_precision_safe_modules`` (which
    modules' gradients DeepSpeed reduces in low precision) is accepted, and gradients are
    reduced in fp32."""

    enabled: Bool = False
    dtype: Literal["bfloat16", "float16", "bf16", "fp16"] = "bfloat16"
    lower_precision_safe_modules: list[str] | None = None


class ZeroTrainOptionsConfig(Section):
    """``zerotrain``: zerotrain's own options about the config itself."""

    # Unknown top-level keys are errors instead of warnings (DeepSpeed ignores them).
    strict_config: Bool = False


class ZeroTrainConfig(Section):
    """The whole config. Batch sizes are resolved against the world size by ``batch.py``."""

    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None

    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: NonNegativeFloat = 0.0
    prescale_gradients: Bool = False
    gradient_predivide_factor: PositiveFloat = 1.0
    # zerotrain's (Megatron's name): nn.Linear weight gradients added into the gradient
    # buffer in place on micro-steps that reduce nothing (zero/fused_wgrad.py).
    gradient_accumulation_fusion: Bool = True
    communication_data_type: DTypeName | None = None
    sparse_gradients: Bool = False
    # DeepSpeed 0.19: false hands the accumulation boundary to the caller (every step()
    # updates); zerotrain counts micro-steps itself, so false is refused.
    managed_gradient_accumulation: Bool = True
    # DeepSpeed keys accepted with a warning that they have no effect here (features.py
    # NO_EFFECT_WHEN_SET says why for each).
    disable_allgather: Bool = False
    seq_parallel_communication_data_type: DTypeName | None = None
    graph_harvesting: Bool = False
    vocabulary_size: NonNegativeInt | None = None
    log_level: str | None = None
    use_data_before_expert_parallelism: Bool = False
    timers: LooseSection | None = None

    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    aio: AioConfig = Field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    dataloader_drop_last: Bool = False

    steps_per_print: PositiveInt = 10
    non_finite_gradients: NonFiniteGradientsConfig = Field(default_factory=NonFiniteGradientsConfig)
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    dump_state: Bool = False
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)

    # Ulysses sequence-parallel degree (DeepSpeed's key); the grid's sequence axis.
    sequence_parallel_size: PositiveInt = 1

    zerotrain: ZeroTrainOptionsConfig = Field(default_factory=ZeroTrainOptionsConfig)

    pipeline: PipelineConfig | None = None
    tensor_parallel: TensorParallelConfig | None = None
    torch_autocast: TorchAutocastConfig | None = None

    # Features zerotrain does not implement (yet): accepted, reported when enabled.
    amp: LooseSection | None = None
    sparse_attention: SparseAttentionConfig | None = None
    curriculum_learning: CurriculumLearningConfig | None = None
    data_efficiency: DataEfficiencyConfig | None = None
    progressive_layer_drop: ProgressiveLayerDropConfig | None = None
    elasticity: ElasticityConfig | None = None
    autotuning: LooseSection | None = None
    compression_training: LooseSection | None = None
    eigenvalue: LooseSection | None = None
    quantize_training: LooseSection | None = None
    hybrid_engine: LooseSection | None = None
    nebula: LooseSection | None = None
    comet: LooseSection | None = None
    expert_parallel: LooseSection | None = None
    weight_quantization: LooseSection | None = None
    # DeepSpeed enables DataStates checkpointing whenever the key is present and not false.
    datastates_ckpt: LooseSection | Bool | None = None
    # DeepSpeed's DeepCompile options; refused when "deepcompile" is true, else no effect.
    compile: LooseSection | None = None

    # Where "auto" values were resolved; filled by the loader and logged at initialize.
    _auto_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def auto_notes(self) -> tuple[str, ...]:
        """Human-readable notes on how each ``"auto"`` value was resolved."""
        return self._auto_notes

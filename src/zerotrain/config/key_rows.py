"""The status of every config key: DeepSpeed 0.19.5's training keys and zerotrain's own.

Data only; ``key_table.py`` checks it against the schema and renders it into
docs/config.md. A "no effect" row quotes the reason ``features.py`` logs, so the table and
the warning cannot say different things.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zerotrain.config.features import NO_EFFECT_WHEN_SET, ZERO_KEYS_ZEROTRAIN_DECIDES
from zerotrain.config.legacy import RENAMED_PATHS


class Status(enum.Enum):
    """What zerotrain does with a key."""

    IMPLEMENTED = "implemented"
    DIFFERS = "implemented (differs)"  # the note says how
    NO_EFFECT = "no effect"  # accepted; initialize logs why (warning or note)
    REFUSED = "refused when enabled"  # initialize raises NotImplementedError naming it
    ZEROTRAIN = "zerotrain only"  # DeepSpeed has no such key
    ALIAS = "alias"  # another spelling, rewritten to ``alias_of`` by legacy.py / loader.py


@dataclass(frozen=True, slots=True)
class KeyRow:
    """One key: its dotted path (``[]`` marks list items, ``<name>`` dict entries)."""

    path: str
    status: Status
    note: str = ""
    alias_of: str | None = None


def _why(path: str) -> str:
    """The reason features.py logs for a key without effect."""
    if path in NO_EFFECT_WHEN_SET:
        return NO_EFFECT_WHEN_SET[path]
    return ZERO_KEYS_ZEROTRAIN_DECIDES[path.removeprefix("zero_optimization.")]


def _impl(path: str, note: str = "") -> KeyRow:
    return KeyRow(path, Status.IMPLEMENTED, note)


def _differs(path: str, note: str) -> KeyRow:
    return KeyRow(path, Status.DIFFERS, note)


def _none(path: str, note: str | None = None) -> KeyRow:
    return KeyRow(path, Status.NO_EFFECT, _why(path) if note is None else note)


def _refused(path: str, note: str) -> KeyRow:
    return KeyRow(path, Status.REFUSED, note)


def _ours(path: str, note: str) -> KeyRow:
    return KeyRow(path, Status.ZEROTRAIN, note)


def _alias(path: str, of: str, note: str = "") -> KeyRow:
    return KeyRow(path, Status.ALIAS, note, of)


def _renamed(parent: str) -> tuple[KeyRow, ...]:
    """Alias rows of legacy.py's renames directly inside ``parent`` ("": the top level):
    the spellings live in one table there."""
    return tuple(
        _alias(old, new) for old, new in RENAMED_PATHS.items() if old.rpartition(".")[0] == parent
    )


_Z = "zero_optimization"
_OO = f"{_Z}.offload_optimizer"
_OP = f"{_Z}.offload_param"
_TP = "tensor_parallel"
_LS = f"{_TP}.partition_config.layer_specs[]"
_DS = "data_efficiency.data_sampling"
_CL = f"{_DS}.curriculum_learning"
_CM = f"{_CL}.curriculum_metrics.<name>"
_LTD = "data_efficiency.data_routing.random_ltd"
_SCHEDULE_KEYS = (
    "min_difficulty",
    "max_difficulty",
    "schedule_type",
    "schedule_config",
    "schedule_config.total_curriculum_step",
    "schedule_config.total_step",
    "schedule_config.difficulty_step",
    "schedule_config.root_degree",
    "schedule_config.difficulty",
    "schedule_config.max_step",
)
_LOOSE = "a DeepSpeed feature zerotrain does not implement; contents are not checked"
_AIO_ONLY = "only used by NVMe offload"

ROWS: tuple[KeyRow, ...] = (
    # Batch and optimization.
    _impl("train_batch_size", "any two of the three batch keys determine the third"),
    _impl("train_micro_batch_size_per_gpu"),
    _impl("gradient_accumulation_steps"),
    _impl("optimizer", "Adam, AdamW, SGD, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb"),
    _differs("optimizer.type", "Adagrad, Lion, MuAdam, MuAdamW, MuSGD are refused"),
    _impl("optimizer.params", "checked against the type; torch_adam and fused have no effect"),
    _none("optimizer.legacy_fusion"),
    _alias("optimizer.params.max_grad_norm", "gradient_clipping"),
    _impl("scheduler", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    _impl("scheduler.type"),
    _impl("scheduler.params", "checked against the type"),
    _impl("gradient_clipping"),
    _impl("prescale_gradients"),
    _impl("gradient_predivide_factor"),
    _ours("zerotrain", "zerotrain's own options about the config"),
    _ours("zerotrain.strict_config", "unknown top-level keys are errors, not warnings"),
    _ours(
        "gradient_accumulation_fusion",
        "nn.Linear weight gradients added in place on micro-steps that reduce nothing",
    ),
    _differs("communication_data_type", "unset: fp32 (DeepSpeed: the compute dtype)"),
    _refused("sparse_gradients", "sparse gradient all-reduce"),
    _refused("managed_gradient_accumulation", "refused when false: zerotrain owns the boundary"),
    _none("disable_allgather"),
    _none("seq_parallel_communication_data_type"),
    _none("graph_harvesting"),
    _none("vocabulary_size"),
    _none("log_level"),
    _none("use_data_before_expert_parallelism"),
    _none("timers"),
    # Precision.
    _impl("fp16"),
    _impl("fp16.enabled"),
    _differs("fp16.auto_cast", "default true (DeepSpeed: false), as FSDP2 casts inputs"),
    _impl("fp16.loss_scale", "0 = dynamic"),
    _impl("fp16.initial_scale_power"),
    _impl("fp16.loss_scale_window"),
    _impl("fp16.hysteresis"),
    _impl("fp16.consecutive_hysteresis"),
    _impl("fp16.min_loss_scale"),
    _refused("fp16.fp16_master_weights_and_grads", "zerotrain keeps fp32 master weights"),
    _impl("bf16", "legacy spelling bfloat16"),
    _impl("bf16.enabled"),
    _ours("bf16.auto_cast", "cast floating-point forward inputs to bf16"),
    _none(
        "bf16.immediate_grad_update",
        "gradients are always added into the accumulation buffer as autograd produces them",
    ),
    _differs(
        "bf16.check_grad_overflow",
        "default false (DeepSpeed: true); non_finite_gradients skips such steps anyway",
    ),
    _refused("bf16.bf16_master_weights_and_grads", "zerotrain keeps fp32 master weights"),
    _refused("bf16.bf16_optimizer_states", "needs bf16 master weights"),
    _ours("bf16.loss_scale", "old DeepSpeed configs carry it; only 1.0 is accepted"),
    *_renamed(""),
    _impl("data_types"),
    _impl("data_types.grad_accum_dtype", "fp32 or the compute dtype"),
    _none("data_types.param_dtype"),
    _none("data_types.buffer_dtype"),
    _differs("torch_autocast", "not yet with a PipelineModule"),
    _impl("torch_autocast.enabled"),
    _differs("torch_autocast.dtype", "bfloat16 runs; float16 is refused (needs a scaler)"),
    _none(
        "torch_autocast.lower_precision_safe_modules",
        "gradients are reduced in fp32 (warned when autocast is enabled)",
    ),
    # ZeRO.
    _impl(_Z),
    _impl(f"{_Z}.stage", "0-3"),
    _differs(f"{_Z}.overlap_comm", "unset: on for GPUs, off for CPUs"),
    _none(f"{_Z}.contiguous_gradients"),
    _none(f"{_Z}.reduce_scatter"),
    _differs(f"{_Z}.reduce_bucket_size", "unset: sized from the model (DeepSpeed: 5e8)"),
    _none(f"{_Z}.use_multi_rank_bucket_allreduce"),
    _none(f"{_Z}.allgather_partitions"),
    _none(f"{_Z}.allgather_bucket_size"),
    _none(f"{_Z}.load_from_fp32_weights"),
    _none(f"{_Z}.elastic_checkpoint"),
    _differs(_OO, "stages 1-3 with Adam/AdamW; refused at stage 0 and with other optimizers"),
    _impl(f"{_OO}.device", "none, cpu, nvme"),
    _impl(f"{_OO}.nvme_path"),
    _impl(f"{_OO}.buffer_count"),
    _differs(f"{_OO}.pin_memory", "default false (DeepSpeed: true)"),
    _none(f"{_OO}.pipeline_read"),
    _none(f"{_OO}.pipeline_write"),
    _none(f"{_OO}.fast_init"),
    _none(f"{_OO}.ratio"),
    _none(f"{_OO}.super_offload", "SuperOffload's superchip scheduling is not implemented"),
    _none(f"{_OO}.cpuadam_cores_perc", "the offloaded Adam runs on torch's CPU threads"),
    _differs(_OP, "acts at stage 3 only (noted otherwise)"),
    _impl(f"{_OP}.device", "none, cpu, nvme"),
    _impl(f"{_OP}.nvme_path"),
    _impl(f"{_OP}.buffer_count"),
    _none(f"{_OP}.buffer_size"),
    _impl(f"{_OP}.max_in_cpu"),
    _differs(f"{_OP}.pin_memory", "default false (DeepSpeed: true)"),
    _none(
        f"{_Z}.zenflow",
        "every gradient is stepped at each step, the exact result ZenFlow approximates",
    ),
    _none(f"{_Z}.sub_group_size"),
    _alias(f"{_Z}.cpu_offload", _OO, 'true = {"device": "cpu"}'),
    _alias(f"{_Z}.cpu_offload_param", _OP, 'true = {"device": "cpu"}'),
    _alias(f"{_Z}.cpu_offload_params", _OP, "older spelling of cpu_offload_param"),
    _alias(f"{_Z}.cpu_offload_use_pin_memory", f"{_OO}.pin_memory", "with cpu_offload(_param)"),
    _impl(f"{_Z}.stage3_prefetch_bucket_size"),
    _differs(f"{_Z}.stage3_param_persistence_threshold", "applies to whole units"),
    _none(f"{_Z}.stage3_model_persistence_threshold"),
    _impl(f"{_Z}.stage3_max_live_parameters", "bounds what prefetching keeps gathered"),
    _none(f"{_Z}.stage3_max_reuse_distance"),
    _impl(f"{_Z}.stage3_gather_16bit_weights_on_model_save"),
    _none(f"{_Z}.stage3_module_granularity_threshold"),
    _none(f"{_Z}.stage3_use_all_reduce_for_fetch_params"),
    _none(f"{_Z}.stage3_allgather_sequential"),
    _ours(f"{_Z}.stage3_unit_classes", "class names of the modules that become stage-3 units"),
    *_renamed(_Z),
    _none(f"{_Z}.ignore_unused_parameters"),
    _none(f"{_Z}.legacy_stage1"),
    _none(f"{_Z}.round_robin_gradients"),
    _refused(f"{_Z}.zero_hpz_partition_size", "above 1: hierarchical partitioning (ZeRO++)"),
    _refused(f"{_Z}.zero_quantized_weights", "quantized ZeRO communication (ZeRO++)"),
    _refused(f"{_Z}.zero_quantized_nontrainable_weights", "quantized frozen weights (ZeRO++)"),
    _refused(f"{_Z}.zero_quantized_gradients", "quantized ZeRO communication (ZeRO++)"),
    _none(f"{_Z}.zeropp_loco_param"),
    _refused(f"{_Z}.mics_shard_size", "above 0: MiCS sharding"),
    _none(f"{_Z}.mics_hierarchical_params_gather"),
    _none(f"{_Z}.memory_efficient_linear"),
    _none(f"{_Z}.pipeline_loading_checkpoint"),
    _none(f"{_Z}.override_module_apply"),
    _none(f"{_Z}.log_trace_cache_warnings"),
    _none(f"{_Z}.enable_sanity_checks"),
    _none(f"{_Z}.save_muon_momentum_buffer_in_memory"),
    _none(f"{_Z}.leaf_module"),
    _none("zero_allow_untested_optimizer", "zerotrain accepts any optimizer"),
    _none("zero_force_ds_cpu_optimizer", "zerotrain accepts any optimizer"),
    # NVMe I/O.
    _impl("aio", _AIO_ONLY),
    _impl("aio.block_size", _AIO_ONLY),
    _none("aio.queue_depth"),
    _impl("aio.thread_count", "I/O threads; DeepSpeed before 0.15 (now intra_op_parallelism)"),
    _none("aio.single_submit"),
    _none("aio.overlap_events"),
    _none("aio.use_gds"),
    _none("aio.intra_op_parallelism"),
    # Activation checkpointing and checkpoints.
    _impl("activation_checkpointing", "see activation_checkpointing.md"),
    _differs(
        "activation_checkpointing.partition_activations",
        "splits over the tensor-parallel group; noted, no effect, without one",
    ),
    _impl("activation_checkpointing.cpu_checkpointing"),
    _impl("activation_checkpointing.contiguous_memory_optimization"),
    _impl("activation_checkpointing.number_checkpoints"),
    _impl("activation_checkpointing.synchronize_checkpoint_boundary"),
    _impl("activation_checkpointing.profile"),
    _ours("activation_checkpointing.block_types", 'checkpoint these blocks; "auto": repeated'),
    _impl("checkpoint"),
    _impl("checkpoint.tag_validation", "Ignore, Warn, Fail"),
    _ours("checkpoint.keep_last", "keep only the newest N complete checkpoints"),
    _refused("checkpoint.load_universal", "universal checkpoints (zerotrain's reshard anyway)"),
    _refused("checkpoint.use_node_local_storage", "node-local checkpoint storage"),
    _none("checkpoint.parallel_write"),
    _none("checkpoint.checkpoint_serialization"),
    _none("checkpoint.writer"),
    _refused("nebula", _LOOSE),
    _refused("datastates_ckpt", "DataStates checkpointing (refused when present and not false)"),
    _impl("dataloader_drop_last"),
    # Logging and monitoring.
    _impl("steps_per_print"),
    _ours("non_finite_gradients", "inf/NaN gradients without fp16's loss scaler"),
    _ours("non_finite_gradients.action", "skip, raise or ignore"),
    _ours("non_finite_gradients.max_consecutive_skips", "this many skips in a row raise"),
    _impl("wall_clock_breakdown"),
    _impl("memory_breakdown"),
    _refused("dump_state", "dump_state"),
    _impl("flops_profiler", "see flops_profiler.md"),
    _impl("flops_profiler.enabled"),
    _none("flops_profiler.recompute_fwd_factor"),
    _differs("flops_profiler.profile_step", "counts optimizer steps from 1; below 1: none"),
    _impl("flops_profiler.module_depth"),
    _impl("flops_profiler.top_modules"),
    _impl("flops_profiler.detailed"),
    _impl("flops_profiler.output_file"),
    *(
        row
        for name in ("tensorboard", "csv_monitor")
        for row in (
            _impl(name, "see monitors.md"),
            _impl(f"{name}.enabled"),
            _impl(f"{name}.output_path"),
            _differs(f"{name}.job_name", 'default "zerotrain_job"'),
        )
    ),
    _impl("wandb", "see monitors.md"),
    _impl("wandb.enabled"),
    _impl("wandb.group"),
    _impl("wandb.team"),
    _differs("wandb.project", 'default "zerotrain"'),
    _refused("comet", "Comet monitoring; " + _LOOSE),
    _impl("comms_logger", "see comms_logger.md"),
    _impl("comms_logger.enabled"),
    _impl("comms_logger.verbose"),
    _impl("comms_logger.prof_all"),
    _impl("comms_logger.debug"),
    _impl("comms_logger.prof_ops"),
    # Parallelism.
    _differs("sequence_parallel_size", "Ulysses; heads and lengths need not divide by it"),
    _impl("pipeline", "see pipeline.md"),
    _impl("pipeline.stages", 'integer or "auto"'),
    _differs("pipeline.partition", 'default "parameters"; DeepSpeed\'s "best" means it'),
    _impl("pipeline.seed_layers"),
    _impl("pipeline.activation_checkpoint_interval"),
    _none("pipeline.pipe_partitioned", "stage messages are sent whole"),
    _none("pipeline.grad_partitioned", "stage messages are sent whole"),
    _none("pipeline.use_reentrant", "activation checkpointing is always non-reentrant"),
    _ours("pipeline.schedule", "1f1b, gpipe, interleaved, zb-h1"),
    _ours("pipeline.virtual_stages", "layer chunks per rank (interleaved)"),
    _ours("pipeline.grad_reduce", "end_of_step or per_microbatch"),
    _ours("pipeline.reshard_after_forward", "stage 3: release parameters between passes"),
    _impl(_TP, "AutoTP training keys; see parallelism.md"),
    _differs(f"{_TP}.autotp_size", "default 1 (DeepSpeed: 0)"),
    _impl(f"{_TP}.preset_model", "llama, mistral, qwen2, gpt"),
    _impl(f"{_TP}.partition_config"),
    _impl(f"{_TP}.partition_config.layer_specs"),
    _impl(f"{_LS}.patterns"),
    _impl(f"{_LS}.partition_type", "column, row, skip"),
    _impl(f"{_LS}.shape"),
    _impl(f"{_LS}.partition_dim"),
    _impl(f"{_LS}.gather_output"),
    _impl(f"{_LS}.model_types"),
    _impl(f"{_TP}.partition_config.use_default_specs"),
    _impl(f"{_TP}.partition_config.strict_mode"),
    _none(f"{_TP}.partition_config.tp_size"),
    _none(f"{_TP}.partition_config.embedding_partition_dim"),
    _none(f"{_TP}.partition_config.lm_head_patterns"),
    _none(f"{_TP}.tp_overlap_comm", "zerotrain overlaps nothing in split layers"),
    _none(f"{_TP}.keep_module_on_host", "the model is split as initialize starts"),
    _none(f"{_TP}.dtype"),
    _none(f"{_TP}.tp"),
    _none(f"{_TP}.injection_policy_tuple"),
    _refused(f"{_TP}.replace_with_kernel_inject", "kernel injection"),
    *_renamed(_TP),
    _ours(f"{_TP}.plan", "{module glob: style}; wins over the specs"),
    _ours(f"{_TP}.sequence_parallel", "Megatron sequence parallelism between split blocks"),
    _refused("expert_parallel", "AutoEP expert parallelism; " + _LOOSE),
    # Model transformations and training efficiency.
    _impl("sparse_attention", "applied at initialize; see sparse_attention.md"),
    *(
        _impl(f"sparse_attention.{key}")
        for key in (
            "mode",
            "block",
            "different_layout_per_head",
            "num_local_blocks",
            "num_global_blocks",
            "attention",
            "horizontal_global_attention",
            "num_different_global_patterns",
            "num_random_blocks",
            "local_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "num_sliding_window_blocks",
        )
    ),
    _ours("sparse_attention.seed", "random blocks; every rank builds the same layout"),
    _ours("sparse_attention.kernel", "auto, blocked, flex"),
    _ours("sparse_attention.max_seq_length", "default: the model's"),
    _impl("progressive_layer_drop"),
    _impl("progressive_layer_drop.enabled"),
    _impl("progressive_layer_drop.theta"),
    _impl("progressive_layer_drop.gamma"),
    _ours("progressive_layer_drop.seed", "the drop draws; every rank makes the same"),
    _ours("progressive_layer_drop.block_types", "more pre-LN block classes to wrap"),
    _impl("curriculum_learning", "legacy block: seqlen curriculum"),
    _impl("curriculum_learning.enabled"),
    _impl("curriculum_learning.curriculum_type", "seqlen"),
    *(_impl(f"curriculum_learning.{key}") for key in _SCHEDULE_KEYS),
    _impl("data_efficiency"),
    _impl("data_efficiency.enabled"),
    _impl("data_efficiency.seed"),
    _impl(_DS),
    _impl(f"{_DS}.enabled"),
    _none(f"{_DS}.num_epochs"),
    _none(f"{_DS}.num_workers"),
    _none(f"{_DS}.pin_memory"),
    _refused(f"{_DS}.dynamic_batching", "dynamic batching (needs DeepSpeed's data analyzer)"),
    _impl(_CL),
    _impl(f"{_CL}.enabled"),
    _refused(f"{_CL}.data_cluster_path", "metric-indexed sampling"),
    _differs(f"{_CL}.curriculum_metrics", "one seqlen_truncate (or seqlen) metric"),
    *(_impl(f"{_CM}.{key}") for key in _SCHEDULE_KEYS),
    _refused(f"{_CM}.index_to_sample_path", "metric-indexed sampling"),
    _refused(f"{_CM}.index_to_metric_path", "metric-indexed sampling"),
    _differs(f"{_CM}.difficulty_type", "value only; percentile is refused"),
    _differs(f"{_CM}.clustering_type", "single_cluster only; schedule_based is refused"),
    _impl("data_efficiency.data_routing"),
    _impl("data_efficiency.data_routing.enabled"),
    _impl(_LTD, "random-LTD; see training_efficiency.md"),
    *(
        _impl(f"{_LTD}.{key}")
        for key in (
            "enabled",
            "total_layer_num",
            "random_ltd_layer_num",
            "random_ltd_layer_id",
            "model_mask_name",
            "model_type",
            "hidden_state_order",
            "random_ltd_schedule",
            "random_ltd_schedule.min_value",
            "random_ltd_schedule.max_value",
            "random_ltd_schedule.schedule_type",
            "random_ltd_schedule.schedule_config",
            "random_ltd_schedule.schedule_config.require_steps",
            "random_ltd_schedule.schedule_config.seq_per_step",
        )
    ),
    _refused(f"{_LTD}.layer_token_lr_schedule", "DeepSpeed never implemented it either"),
    *(
        _refused(f"{_LTD}.layer_token_lr_schedule.{key}", "with its section")
        for key in ("enabled", "total_layer_tokens", "warmup_type", "warmup_layer_tokens")
    ),
    _ours(f"{_LTD}.block_types", "more block classes to wrap"),
    # DeepSpeed features zerotrain does not implement: sections kept loosely.
    _refused("amp", "NVIDIA Apex AMP; " + _LOOSE),
    # Elasticity (DeepSpeed 0.19.5's; 0.19.8 removed it): the batch sizes for any world size.
    _impl("elasticity", "the batch keys come from the elastic plan (zerotrain elastic-plan)"),
    _impl("elasticity.enabled"),
    _impl("elasticity.max_train_batch_size", "required when enabled"),
    _impl("elasticity.micro_batch_sizes", "required when enabled"),
    _impl("elasticity.min_gpus", "data-parallel world sizes, as DeepSpeed counts them"),
    _impl("elasticity.max_gpus"),
    _impl("elasticity.num_gpus_per_node", "version 0.2 plans per node"),
    _impl("elasticity.model_parallel_size", "version 0.2 only, as in DeepSpeed"),
    _none("elasticity.min_time"),
    _impl("elasticity.prefer_larger_batch"),
    _impl(
        "elasticity.ignore_non_elastic_batch_info",
        "false: batch keys beside the section are an error; true: overridden, with a warning "
        "(DeepSpeed overrides them silently)",
    ),
    _impl("elasticity.version", "0.1 or 0.2 (the default)"),
    _refused("autotuning", _LOOSE),
    _refused("compression_training", "refused when present; " + _LOOSE),
    _refused("eigenvalue", "DeepSpeed 0.19.5 reads it inside quantize_training; " + _LOOSE),
    _refused("quantize_training", _LOOSE),
    _refused("hybrid_engine", _LOOSE),
    _refused("weight_quantization", "refused when present; " + _LOOSE),
    _refused("compile", "refused when deepcompile is true; otherwise no effect (warned)"),
)

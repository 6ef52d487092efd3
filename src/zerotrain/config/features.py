"""Which configured features this version can run, and which keys have no effect.

A config may name any DeepSpeed feature; enabling one that zerotrain does not implement yet is
an error at ``initialize`` that names the key (never a silent no-op). Keys that are valid but
do nothing in the chosen configuration (stage-3 knobs at stage 0, say) are reported as notes.
"""

from __future__ import annotations

from types import MappingProxyType

from pydantic import BaseModel

from zerotrain.config import optim_params
from zerotrain.config.efficiency import SEQLEN_METRICS
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.types import LooseSection

IMPLEMENTED_STAGES: tuple[int, ...] = (0, 1, 2, 3)

# Loose sections and the rule that says they are switched on.
_LOOSE_ENABLED_BY_FLAG = (
    "amp",
    "autotuning",
    "eigenvalue",
    "quantize_training",
    "hybrid_engine",
    "nebula",
    "comet",
    "expert_parallel",
)
_LOOSE_ENABLED_BY_PRESENCE = ("compression_training", "weight_quantization")

# zero_optimization keys that only act at a given stage or above.
_ZERO_KEYS_FROM_STAGE = MappingProxyType(
    {
        "allgather_partitions": 1,
        "allgather_bucket_size": 1,
        "reduce_scatter": 2,
        "contiguous_gradients": 2,
        "round_robin_gradients": 2,
        "elastic_checkpoint": 1,
        "load_from_fp32_weights": 1,
        "legacy_stage1": 1,
        "sub_group_size": 3,
        "stage3_prefetch_bucket_size": 3,
        "stage3_param_persistence_threshold": 3,
        "stage3_max_live_parameters": 3,
        "stage3_max_reuse_distance": 3,
        "stage3_gather_16bit_weights_on_model_save": 3,
        "stage3_unit_classes": 3,
        "memory_efficient_linear": 3,
    }
)


# DeepSpeed tuning knobs for its own implementation, and what zerotrain does instead.
ZERO_KEYS_ZEROTRAIN_DECIDES = MappingProxyType(
    {
        "allgather_partitions": "updated shards are always all-gathered (on gloo as one "
        "broadcast per shard)",
        "allgather_bucket_size": "each unit's shards are all-gathered together; units are "
        "sized by reduce_bucket_size",
        "reduce_scatter": "gradients are always reduce-scattered at stages 1-2",
        "contiguous_gradients": "the gradient partition is always one contiguous buffer",
        "round_robin_gradients": "each rank reduces into its own contiguous partition",
        "legacy_stage1": "there is one implementation of stage 1",
        "load_from_fp32_weights": "a checkpoint's fp32 master weights are always restored "
        "where it saved them",
        "ignore_unused_parameters": "parameters without a gradient are always handled "
        "(left untouched, as in plain PyTorch)",
        "elastic_checkpoint": "checkpoints will not depend on the world size",
        "stage3_max_reuse_distance": "a unit is freed after each use and gathered again "
        "when needed (prefetched from the previous pass's order)",
        "sub_group_size": "each unit's slice is stepped as one tensor per optimizer group",
        "memory_efficient_linear": "zerotrain does not replace the model's linear layers",
        "use_multi_rank_bucket_allreduce": "stage 0 reduces each bucket with one "
        "all-reduce over the whole group",
        "stage3_model_persistence_threshold": "persistence is decided per unit by "
        "stage3_param_persistence_threshold, with no model-wide cap",
        "stage3_module_granularity_threshold": "stage-3 units are the repeated blocks or "
        "stage3_unit_classes",
        "stage3_use_all_reduce_for_fetch_params": "stage-3 units are always all-gathered",
        "stage3_allgather_sequential": "each unit is all-gathered as one flat buffer",
        "zeropp_loco_param": "it tunes ZeRO++ quantized gradients, which are not implemented",
        "mics_hierarchical_params_gather": "it tunes MiCS, which is not implemented",
        "pipeline_loading_checkpoint": "checkpoints are loaded into the sharded layout "
        "whatever the pipeline setup",
        "override_module_apply": "zerotrain does not patch nn.Module.apply; gather stage-3 "
        "parameters with GatheredParameters to change them",
        "log_trace_cache_warnings": "prefetching follows the previous pass's order and "
        "logs no trace warnings",
        "enable_sanity_checks": "broken invariants always raise",
        "save_muon_momentum_buffer_in_memory": "the Muon optimizer is not implemented",
        "leaf_module": "stage-3 units are chosen by stage3_unit_classes (class names), "
        "which is the closest equivalent",
    }
)

# Keys of current DeepSpeed releases that do nothing here whatever their value: each,
# when written in the config, draws one warning at initialize with the reason (dotted
# path -> why). docs/config.md's key table quotes these reasons.
NO_EFFECT_WHEN_SET: MappingProxyType[str, str] = MappingProxyType(
    {
        "disable_allgather": "zerotrain picks the collective that shares updated shards "
        "itself (all-gather, or broadcasts on gloo)",
        "seq_parallel_communication_data_type": "the Ulysses all-to-alls carry activations "
        "in the dtype the model computes in",
        "graph_harvesting": "zerotrain captures no graphs of its optimizer step",
        "vocabulary_size": "DeepSpeed only warned when it is not a multiple of 8; zerotrain "
        "does not check it",
        "log_level": "set the level with the ZEROTRAIN_LOG_LEVEL environment variable",
        "use_data_before_expert_parallelism": "it orders the axes of expert-parallel "
        "groups, and zerotrain has no expert parallelism",
        "timers": "DeepSpeed's throughput timer; zerotrain reports step times with "
        "wall_clock_breakdown",
        "optimizer.legacy_fusion": "zerotrain chooses the optimizer kernel itself",
        "data_types.param_dtype": "DeepSpeed only checked it against fp16/bf16; the "
        "precision sections set the parameter dtype",
        "data_types.buffer_dtype": "buffers are cast with the parameters to the dtype the "
        "precision sections choose",
        "checkpoint.checkpoint_serialization": "zerotrain writes its own checkpoint files "
        "(safetensors shards and a manifest)",
        "checkpoint.writer": "zerotrain writes its own checkpoint files (DeepSpeed's "
        "FastPersist writer is not used)",
        "checkpoint.parallel_write": "every rank writes its own files; there is no "
        "pipeline-stage write schedule",
        "zero_optimization.offload_optimizer.pipeline_read": "zerotrain's NVMe swapper "
        "schedules its own reads",
        "zero_optimization.offload_optimizer.pipeline_write": "zerotrain's NVMe swapper "
        "schedules its own writes",
        "zero_optimization.offload_optimizer.fast_init": "offloaded states are created "
        "directly where they live",
        "zero_optimization.offload_optimizer.ratio": "the whole optimizer step is offloaded "
        "(partial offload is not implemented)",
        "zero_optimization.offload_param.buffer_size": "parameter shards are swapped whole, "
        "in buffer_count buffers",
        "aio.queue_depth": "zerotrain's NVMe I/O is tuned by aio.thread_count and "
        "aio.block_size only",
        "aio.single_submit": "zerotrain's NVMe I/O is tuned by aio.thread_count and "
        "aio.block_size only",
        "aio.overlap_events": "zerotrain's NVMe I/O is tuned by aio.thread_count and "
        "aio.block_size only",
        "aio.use_gds": "GPUDirect Storage is not used; NVMe I/O goes through host memory",
        "aio.intra_op_parallelism": "zerotrain's NVMe I/O is tuned by aio.thread_count and "
        "aio.block_size only",
        "flops_profiler.recompute_fwd_factor": "the profiler reports the forward as "
        "measured, without a recomputation estimate",
        "data_efficiency.data_sampling.num_epochs": "the seqlen curriculum truncates the "
        "batches of your own data loader; there is no curriculum sampler",
        "data_efficiency.data_sampling.num_workers": "the seqlen curriculum truncates the "
        "batches of your own data loader; there is no curriculum sampler",
        "data_efficiency.data_sampling.pin_memory": "the seqlen curriculum truncates the "
        "batches of your own data loader; there is no curriculum sampler",
        "elasticity.min_time": "it is for the scheduler that resizes the job; the engine "
        "does not read it (nor does DeepSpeed's)",
        "tensor_parallel.dtype": "split layers keep the dtype the precision sections give "
        "the model",
        "tensor_parallel.tp": "inference tensor-parallel options; training splits by autotp_size",
        "tensor_parallel.injection_policy_tuple": "zerotrain splits layers by "
        "partition_config, preset_model or plan, never by injection policies",
        "tensor_parallel.partition_config.tp_size": "the degree is tensor_parallel.autotp_size",
        "tensor_parallel.partition_config.embedding_partition_dim": "embeddings stay whole "
        "(DeepSpeed's AutoTP training does not read it either)",
        "tensor_parallel.partition_config.lm_head_patterns": "the output head stays whole "
        "(DeepSpeed's AutoTP training does not read it either)",
    }
)


def _loose_enabled(name: str, section: LooseSection) -> bool:
    if name in _LOOSE_ENABLED_BY_PRESENCE:
        return True
    return bool(section.enabled)


# Optimizers the offloaded step implements (config names, lower-case).
OFFLOAD_OPTIMIZERS = frozenset({"adam", "adamw"})


def not_implemented(cfg: ZeroTrainConfig) -> list[str]:
    """Every enabled feature this version cannot run, as ``"path=value: explanation"``."""
    found: list[str] = []
    zero = cfg.zero_optimization
    if zero.stage not in IMPLEMENTED_STAGES:
        found.append(
            f"zero_optimization.stage={zero.stage}: ZeRO stage {zero.stage} is not implemented "
            f"yet (available: {', '.join(map(str, IMPLEMENTED_STAGES))})"
        )
    offload = zero.offload_optimizer.device
    if offload != "none" and zero.stage == 0:
        found.append(
            f"zero_optimization.offload_optimizer.device={offload} at stage 0: offload steps "
            "partitioned optimizer states (use stage 1, 2 or 3)"
        )
    offloads = zero.offload_optimizer.device != "none" or (
        zero.stage == 3 and zero.offload_param.device != "none"
    )
    chosen = optim_params.canonical_optimizer(cfg.optimizer.type) if cfg.optimizer else "adam"
    if offloads and chosen not in OFFLOAD_OPTIMIZERS:
        found.append(
            f"optimizer.type={chosen} with offload: the offloaded step runs "
            f"{' or '.join(sorted(OFFLOAD_OPTIMIZERS))}"
        )
    for key in (
        "zero_quantized_weights",
        "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights",
    ):
        if getattr(zero, key):
            found.append(f"zero_optimization.{key}=true: quantized ZeRO communication")
    if zero.zero_hpz_partition_size > 1:
        found.append("zero_optimization.zero_hpz_partition_size>1: hierarchical partitioning")
    if zero.mics_shard_size > 0:
        found.append("zero_optimization.mics_shard_size>0: MiCS sharding")
    if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads:
        found.append(
            "bf16.bf16_master_weights_and_grads=true (and bf16_optimizer_states): bf16 master "
            "weights and optimizer states (zerotrain keeps fp32 master weights)"
        )
    autocast = cfg.torch_autocast
    if autocast is not None and autocast.enabled and autocast.dtype in ("float16", "fp16"):
        found.append(
            f"torch_autocast.dtype={autocast.dtype}: fp16 autocast (it needs a gradient "
            "scaler); use bfloat16, or the fp16 section"
        )
    if cfg.fp16.enabled and cfg.fp16.fp16_master_weights_and_grads:
        found.append(
            "fp16.fp16_master_weights_and_grads=true: fp16 master weights (zerotrain keeps "
            "fp32 master weights)"
        )
    if cfg.sparse_gradients:
        found.append("sparse_gradients=true: sparse gradient all-reduce")
    found += _recent_deepspeed_not_implemented(cfg)
    if cfg.optimizer is not None:
        key = optim_params.canonical_optimizer(cfg.optimizer.type)
        if key in optim_params.OPTIMIZERS_NOT_IMPLEMENTED:
            found.append(f"optimizer.type={cfg.optimizer.type}: this optimizer")
    if cfg.scheduler is not None:
        name = optim_params.canonical_scheduler(cfg.scheduler.type)
        if name in optim_params.SCHEDULERS_NOT_IMPLEMENTED:
            found.append(f"scheduler.type={cfg.scheduler.type}: this scheduler")
    if cfg.dump_state:
        found.append("dump_state=true: dump_state")
    if cfg.checkpoint.load_universal or cfg.checkpoint.use_node_local_storage:
        found.append("checkpoint.load_universal/use_node_local_storage: checkpoint options")
    found += _data_efficiency_not_implemented(cfg)
    for name in (*_LOOSE_ENABLED_BY_FLAG, *_LOOSE_ENABLED_BY_PRESENCE):
        section = getattr(cfg, name)
        if section is not None and _loose_enabled(name, section):
            found.append(f"{name}: {name.replace('_', ' ')}")
    return found


def _recent_deepspeed_not_implemented(cfg: ZeroTrainConfig) -> list[str]:
    """Enabled features of DeepSpeed 0.17-0.19 keys that this version cannot run."""
    found: list[str] = []
    if not cfg.managed_gradient_accumulation:
        found.append(
            "managed_gradient_accumulation=false: caller-owned accumulation boundaries "
            "(zerotrain counts micro-steps against gradient_accumulation_steps)"
        )
    if cfg.tensor_parallel is not None and cfg.tensor_parallel.replace_with_kernel_inject:
        found.append("tensor_parallel.replace_with_kernel_inject=true: kernel injection")
    if cfg.datastates_ckpt is not None and cfg.datastates_ckpt is not False:
        found.append("datastates_ckpt: DataStates asynchronous checkpointing")
    if cfg.compile is not None and (cfg.compile.model_extra or {}).get("deepcompile"):
        found.append("compile.deepcompile=true: DeepCompile")
    sampling = cfg.data_efficiency.data_sampling if cfg.data_efficiency else None
    batching = sampling.dynamic_batching if sampling is not None else None
    if batching is not None and batching.enabled:
        found.append(
            "data_efficiency.data_sampling.dynamic_batching: dynamic batching (needs "
            "DeepSpeed's data analyzer's metrics)"
        )
    return found


def _data_efficiency_not_implemented(cfg: ZeroTrainConfig) -> list[str]:
    """The parts of ``data_efficiency`` that need DeepSpeed's offline data analyzer (metric-
    indexed sampling), named by key; the seqlen curriculum and random-LTD run."""
    section = cfg.data_efficiency
    if section is None or not (section.enabled and section.data_sampling.enabled):
        return []
    base = "data_efficiency.data_sampling.curriculum_learning"
    curriculum = section.data_sampling.curriculum_learning
    if not curriculum.enabled:
        return []
    found = []
    analyzer = "metric-indexed sampling (needs DeepSpeed's offline data analyzer's index files)"
    if curriculum.data_cluster_path:
        found.append(f"{base}.data_cluster_path: {analyzer}")
    for name, metric in curriculum.curriculum_metrics.items():
        where = f"{base}.curriculum_metrics.{name}"
        if name not in SEQLEN_METRICS:
            found.append(
                f"{where}: {analyzer}; the metrics that run are {', '.join(SEQLEN_METRICS)} "
                "(sequence-length truncation)"
            )
            continue
        for key in ("index_to_sample_path", "index_to_metric_path"):
            if getattr(metric, key):
                found.append(f"{where}.{key}: {analyzer}")
        if metric.difficulty_type != "value" or metric.clustering_type != "single_cluster":
            found.append(
                f"{where}.difficulty_type/clustering_type: percentile difficulties and "
                "schedule-based clusters are metric-indexed sampling"
            )
    if len(curriculum.curriculum_metrics) > 1:
        found.append(f"{base}.curriculum_metrics: more than one metric at once")
    if cfg.curriculum_learning is not None and cfg.curriculum_learning.enabled:
        found.append(f"{base} together with the legacy curriculum_learning block")
    return found


def tensor_parallel_size(cfg: ZeroTrainConfig) -> int:
    """The tensor-parallel degree the config asks for (1 without the section)."""
    return 1 if cfg.tensor_parallel is None else cfg.tensor_parallel.autotp_size


def pipeline_stages(cfg: ZeroTrainConfig) -> int:
    """The pipeline stages the config asks for (``pipeline.stages``; 1 without the section
    or for ``"auto"``, where the PipelineModule's own count decides)."""
    stages = 1 if cfg.pipeline is None else cfg.pipeline.stages
    return 1 if stages == "auto" else stages


def inert_keys(cfg: ZeroTrainConfig) -> list[str]:
    """Explicitly set keys that have no effect in this configuration (logged as notes)."""
    notes: list[str] = []
    zero = cfg.zero_optimization
    for key in sorted(zero.model_fields_set):
        stage = _ZERO_KEYS_FROM_STAGE.get(key)
        if key in ZERO_KEYS_ZEROTRAIN_DECIDES:
            notes.append(
                f"zero_optimization.{key} has no effect: {ZERO_KEYS_ZEROTRAIN_DECIDES[key]}"
            )
        elif stage is not None and zero.stage < stage:
            notes.append(
                f"zero_optimization.{key} acts only at stage >= {stage} "
                f"(this config uses stage {zero.stage})"
            )
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
        if key in cfg.model_fields_set:
            notes.append(f"{key}: zerotrain accepts any optimizer; this key has no effect")
    if cfg.optimizer is not None:
        for key in ("torch_adam", "fused"):
            if key in cfg.optimizer.params and cfg.optimizer.params[key] is not None:
                notes.append(
                    f"optimizer.params.{key}: zerotrain chooses the kernel itself "
                    "(fused where torch has one); this key has no effect"
                )
    if cfg.bf16.enabled and "immediate_grad_update" in cfg.bf16.model_fields_set:
        notes.append(
            "bf16.immediate_grad_update: gradients are always added into the accumulation "
            "buffer as autograd produces them; this key has no effect"
        )
    if cfg.tensor_parallel is not None:
        for key in ("tp_overlap_comm", "keep_module_on_host"):
            if getattr(cfg.tensor_parallel, key):
                notes.append(
                    f"tensor_parallel.{key}: zerotrain splits the model as initialize starts "
                    "and overlaps nothing there; this key has no effect"
                )
    if cfg.activation_checkpointing.partition_activations and tensor_parallel_size(cfg) == 1:
        notes.append(
            "activation_checkpointing.partition_activations splits checkpoint inputs over the "
            "tensor-parallel group; without tensor parallelism (size 1) it has no effect"
        )
    if zero.offload_param.device != "none" and zero.stage < 3:
        notes.append(
            f"zero_optimization.offload_param acts only at stage 3 (parameters are whole on "
            f"every rank at stage {zero.stage}); it has no effect"
        )
    if cfg.pipeline is not None:
        for key in ("pipe_partitioned", "grad_partitioned"):
            if key in cfg.pipeline.model_fields_set:
                notes.append(
                    f"pipeline.{key}: DeepSpeed splits stage messages over the tensor-parallel "
                    "group; zerotrain sends them whole, so this key has no effect"
                )
        if "use_reentrant" in cfg.pipeline.model_fields_set:
            notes.append(
                "pipeline.use_reentrant: zerotrain's activation checkpointing is always "
                "non-reentrant; this key has no effect"
            )
    uses_nvme = "nvme" in (zero.offload_optimizer.device, zero.offload_param.device)
    if "aio" in cfg.model_fields_set and not uses_nvme:
        notes.append("aio: only used by NVMe offload, which this config does not enable")
    return notes


def _is_set(cfg: ZeroTrainConfig, path: str) -> bool:
    """Whether the config writes the key at dotted ``path`` (sections it lacks write none)."""
    *parents, key = path.split(".")
    node: object = cfg
    for part in parents:
        node = getattr(node, part, None)
    return isinstance(node, BaseModel) and key in node.model_fields_set


def ignored_keys(cfg: ZeroTrainConfig) -> list[str]:
    """Keys of current DeepSpeed releases that are accepted but have no effect here, each
    with the reason (logged as warnings at ``initialize``: a DeepSpeed user expects them to
    do something)."""
    found = [
        f"{path} has no effect: {why}"
        for path, why in NO_EFFECT_WHEN_SET.items()
        if _is_set(cfg, path)
    ]
    if cfg.compile is not None and not (cfg.compile.model_extra or {}).get("deepcompile"):
        found.append(
            "compile has no effect: its keys tune DeepCompile, which is off (and not "
            "implemented); use torch.compile on the model"
        )
    zero = cfg.zero_optimization
    if zero.zenflow is not None and zero.zenflow.enabled is not False:
        found.append(
            "zero_optimization.zenflow has no effect: zerotrain steps every gradient at each "
            "step (ZenFlow's top-k now, rest later updates are not implemented), which gives "
            "the exact result ZenFlow approximates"
        )
    offload = zero.offload_optimizer
    for key in ("super_offload", "cpuadam_cores_perc"):
        if key in offload.model_fields_set:
            found.append(
                f"zero_optimization.offload_optimizer.{key} has no effect: zerotrain's "
                "offloaded Adam streams states chunk by chunk on torch's CPU threads "
                "(SuperOffload's superchip scheduling is not implemented)"
            )
    autocast = cfg.torch_autocast
    if autocast is not None and autocast.enabled and autocast.lower_precision_safe_modules:
        found.append(
            "torch_autocast.lower_precision_safe_modules has no effect on communication: "
            "zerotrain reduces every gradient in fp32 (DeepSpeed reduced those modules' in "
            "the autocast dtype)"
        )
    return found

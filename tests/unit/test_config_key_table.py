"""The key table (config/key_rows.py) against the schema, the code and docs/config.md: every
schema key has a row and every row a key, each status is what load_config and features.py
actually do, and the generated section of the docs is current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic_core import PydanticUndefined

from zerotrain.config import load_config
from zerotrain.config.features import ignored_keys, inert_keys, not_implemented
from zerotrain.config.key_table import ROWS, KeyRow, Status, main, render, schema_fields, splice
from zerotrain.config.legacy import RENAMED_PATHS
from zerotrain.config.schema import ZeroTrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
FIELDS = dict(schema_fields())

# Values that make a key show its status where its default cannot (None, or a default that
# does not enable the feature), and the config around it that the status needs.
EXAMPLES: dict[str, Any] = {
    "optimizer.legacy_fusion": True,
    "seq_parallel_communication_data_type": "bf16",
    "vocabulary_size": 50257,
    "log_level": "info",
    "timers": {"throughput": {"enabled": False}},
    "data_types.param_dtype": "bf16",
    "data_types.buffer_dtype": "fp32",
    "torch_autocast.lower_precision_safe_modules": ["torch.nn.Linear"],
    "zero_optimization.zenflow": {"topk_ratio": 0.1},
    "zero_optimization.stage3_model_persistence_threshold": 1000,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8},
    "zero_optimization.leaf_module": {"classes": ["MoEBlock"]},
    "checkpoint.writer": {"type": "fast"},
    "checkpoint.parallel_write": {"pipeline_stage": True},
    # Off is what zerotrain does anyway; only turning them on is noted.
    "tensor_parallel.tp_overlap_comm": True,
    "tensor_parallel.keep_module_on_host": True,
    "tensor_parallel.dtype": "bf16",
    "tensor_parallel.tp": {"tp_size": 1},
    "tensor_parallel.injection_policy_tuple": ["Block"],
    "tensor_parallel.partition_config.tp_size": 2,
    "tensor_parallel.partition_config.embedding_partition_dim": 0,
    "tensor_parallel.partition_config.lm_head_patterns": ["lm_head"],
    # Refused when enabled.
    "sparse_gradients": True,
    "managed_gradient_accumulation": False,
    "zero_optimization.zero_hpz_partition_size": 2,
    "zero_optimization.mics_shard_size": 2,
    "bf16.bf16_optimizer_states": True,
    "checkpoint.load_universal": True,
    "checkpoint.use_node_local_storage": True,
    "dump_state": True,
    "datastates_ckpt": {"enable": True},
    "compile": {"deepcompile": True},
    "compression_training": {},
    "weight_quantization": {"quantized_initialization": {}},
    "data_efficiency.data_sampling.dynamic_batching": {"enabled": True},
}
CONTEXT: dict[str, dict[str, Any]] = {
    "bf16.immediate_grad_update": {"bf16": {"enabled": True}},
    "bf16.bf16_master_weights_and_grads": {"bf16": {"enabled": True}},
    "fp16.fp16_master_weights_and_grads": {"fp16": {"enabled": True}},
    "bf16.bf16_optimizer_states": {
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}
    },
    "torch_autocast.lower_precision_safe_modules": {"torch_autocast": {"enabled": True}},
    "data_efficiency.data_sampling.dynamic_batching": {
        "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}
    },
    "data_efficiency.data_sampling.curriculum_learning.data_cluster_path": {
        "data_efficiency": {
            "enabled": True,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "curriculum_metrics": {
                        "seqlen_truncate": {
                            "min_difficulty": 8,
                            "max_difficulty": 64,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {
                                "total_curriculum_step": 10,
                                "difficulty_step": 8,
                            },
                        }
                    },
                },
            },
        }
    },
}
EXAMPLES["data_efficiency.data_sampling.curriculum_learning.data_cluster_path"] = "clusters/"
# Refused by initialize outside features.not_implemented (engine/efficiency.py), or only
# through a parent section: checked by their own tests.
REFUSED_ELSEWHERE = ("data_efficiency.data_routing.random_ltd.layer_token_lr_schedule",)
# Sections whose keys are required together: one key alone is a config error.
NEEDS_SIBLINGS = ("data_efficiency.data_routing.random_ltd.random_ltd_schedule.",)


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _config_setting(path: str, value: Any) -> dict[str, Any]:
    """A minimal config that writes ``value`` at ``path`` (with the row's context)."""
    raw: dict[str, Any] = {"train_batch_size": 4}
    if path.startswith(("optimizer.", "scheduler.")):  # their type is required
        kind = path.split(".")[0]
        raw[kind] = {"type": "Adam" if kind == "optimizer" else "WarmupLR"}
    _merge(raw, CONTEXT.get(path, {}))
    node = raw
    *parents, key = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[key] = value
    return raw


def _example(row: KeyRow) -> Any:
    """The value a test writes for the row; PydanticUndefined when there is none."""
    if row.path in EXAMPLES:
        return EXAMPLES[row.path]
    field = FIELDS[row.path]
    if field.default_factory is not None or field.default in (None, PydanticUndefined):
        return PydanticUndefined
    return field.default


def _testable(status: Status) -> list[KeyRow]:
    return [
        row
        for row in ROWS
        if row.status is status
        and "[]" not in row.path
        and "<name>" not in row.path
        and not row.path.startswith(REFUSED_ELSEWHERE + NEEDS_SIBLINGS)
    ]


# -- (a) one row per schema key --------------------------------------------------------------


def test_every_schema_key_has_one_row_and_every_row_a_key():
    paths = [row.path for row in ROWS]
    assert len(paths) == len(set(paths)), "duplicate rows"
    keys = {row.path for row in ROWS if row.status is not Status.ALIAS}
    assert sorted(set(FIELDS) - keys) == [], "schema keys without a row"
    assert sorted(keys - set(FIELDS)) == [], "rows for keys the schema lacks"


def test_alias_rows_cover_the_renames_and_point_at_schema_keys():
    aliases = {row.path: row.alias_of for row in ROWS if row.status is Status.ALIAS}
    assert all(target in FIELDS for target in aliases.values())
    assert not set(aliases) & set(FIELDS)
    for old, new in RENAMED_PATHS.items():
        assert aliases.get(old) == new, old


@pytest.mark.parametrize(
    "row",
    [row for row in ROWS if row.status is Status.ALIAS and row.path in RENAMED_PATHS],
    ids=lambda row: row.path,
)
def test_alias_loads_as_its_target(row: KeyRow):
    target = FIELDS[row.alias_of or ""]
    value = EXAMPLES.get(row.alias_of or "", target.default)
    cfg = load_config(_config_setting(row.path, value))
    *parents, key = (row.alias_of or "").split(".")
    node: Any = cfg
    for part in parents:
        node = getattr(node, part)
    assert key in node.model_fields_set


def test_legacy_offload_flags_and_max_grad_norm_load():
    cfg = load_config(
        {
            "train_batch_size": 4,
            "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}},
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
            },
        }
    )
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory
    assert cfg.gradient_clipping == 1.0


# -- (b) the statuses are what the code does -------------------------------------------------


@pytest.mark.parametrize("row", _testable(Status.NO_EFFECT), ids=lambda row: row.path)
def test_no_effect_keys_are_accepted_and_logged_with_their_path(row: KeyRow):
    value = _example(row)
    assert value is not PydanticUndefined, f"add an example for {row.path}"
    cfg = load_config(_config_setting(row.path, value))
    assert not_implemented(cfg) == []
    logged = [*ignored_keys(cfg), *inert_keys(cfg)]
    assert any(row.path in line and "no effect" in line for line in logged), logged


@pytest.mark.parametrize("row", _testable(Status.REFUSED), ids=lambda row: row.path)
def test_refused_keys_are_named_by_not_implemented(row: KeyRow):
    value = EXAMPLES.get(row.path, {"enabled": True})
    if row.path not in EXAMPLES and isinstance(FIELDS[row.path].default, bool):
        value = not FIELDS[row.path].default
    cfg = load_config(_config_setting(row.path, value))
    refused = not_implemented(cfg)
    # A message may name keys refused together ("checkpoint.load_universal/..."); it starts
    # with the section and names the key.
    section, _, key = row.path.rpartition(".")
    assert any(
        line.startswith(row.path) or (line.startswith(section) and key in line) for line in refused
    ), refused


@pytest.mark.parametrize(
    "row",
    # Sections and keys without a default have no value to write without more context.
    [
        row
        for row in (*_testable(Status.IMPLEMENTED), *_testable(Status.ZEROTRAIN))
        if _example(row) is not PydanticUndefined
    ],
    ids=lambda row: row.path,
)
def test_implemented_keys_are_neither_refused_nor_ignored(row: KeyRow):
    cfg = load_config(_config_setting(row.path, _example(row)))
    said = [*not_implemented(cfg), *ignored_keys(cfg), *inert_keys(cfg)]
    assert not any(row.path in line and "no effect" in line for line in said), said
    assert not any(line.startswith(row.path) for line in not_implemented(cfg))


def test_defaults_refuse_and_warn_nothing():
    cfg = load_config({"train_batch_size": 4})
    assert isinstance(cfg, ZeroTrainConfig)
    assert not_implemented(cfg) == []
    assert ignored_keys(cfg) == []


# -- (c) docs/config.md is generated from the table ------------------------------------------


def test_docs_key_table_is_current():
    document = DOC.read_text(encoding="utf-8")
    assert splice(document, render()) == document, (
        "docs/config.md's key table is stale: run "
        "python -m zerotrain.config.key_table --write docs/config.md"
    )
    assert main(["--check", str(DOC)]) == 0


def test_splice_replaces_only_between_the_markers():
    document = "intro\n<!-- key-table:start -->\nold\n<!-- key-table:end -->\noutro\n"
    assert splice(document, "new\n") == (
        "intro\n<!-- key-table:start -->\nnew\n<!-- key-table:end -->\noutro\n"
    )
    with pytest.raises(ValueError, match="expected one"):
        splice("no markers", "new\n")

"""Config loading: every kind of bad input gets a message with path, value and what is allowed."""

from __future__ import annotations

import json
import logging

import pytest

from zerotrain.config import ConfigError, load_config, resolve_batch_sizes, to_policies
from zerotrain.config.features import inert_keys, not_implemented


def problems(config: dict | str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return [str(p) for p in info.value.problems]


def only_problem(config: dict | str) -> str:
    found = problems(config)
    assert len(found) == 1, found
    return found[0]


# -- unknown keys ---------------------------------------------------------------------------


STRICT = {"zerotrain": {"strict_config": True}}


def _warnings_of(config: dict, caplog: pytest.LogCaptureFixture) -> str:
    caplog.set_level(logging.WARNING)
    logger = logging.getLogger("zerotrain")
    logger.addHandler(caplog.handler)
    try:
        load_config(config)
    finally:
        logger.removeHandler(caplog.handler)
    return caplog.text


def test_unknown_top_level_key_is_a_warning_naming_the_nearest_known_key(caplog):
    # DeepSpeed drops unknown top-level keys without a word; zerotrain drops them with one.
    text = _warnings_of({"train_batch_size": 8, "zero_optimisation": {"stage": 0}}, caplog)
    assert (
        "ignoring unknown top-level key 'zero_optimisation'; "
        "the nearest known key is 'zero_optimization'"
    ) in text
    text = _warnings_of({"train_batch_size": 8, "qwertyuiop": 1}, caplog)
    assert "ignoring unknown top-level key 'qwertyuiop'; the nearest known key is '" in text


def test_strict_config_refuses_unknown_top_level_keys():
    message = only_problem({"train_batch_size": 8, "zero_optimisation": {"stage": 0}, **STRICT})
    assert message.startswith("zero_optimisation:")
    assert "unknown key 'zero_optimisation'" in message
    assert "did you mean 'zero_optimization'?" in message
    with pytest.raises(ConfigError):  # the argument, or its environment variable, too
        load_config({"train_batch_size": 8, "zero_optimisation": {}}, unknown_keys="error")
    assert "strict_config: got 'yes'" in only_problem({"zerotrain": {"strict_config": "yes"}})


def test_unknown_nested_key_names_full_path():
    message = only_problem(
        {"train_batch_size": 8, "zero_optimization": {"stage3_param_persitance_threshold": 1e5}}
    )
    assert message.startswith("zero_optimization.stage3_param_persitance_threshold:")
    assert "did you mean 'stage3_param_persistence_threshold'?" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = only_problem({"fp16": {"enabled": False, "qwerty": 1}})
    assert message.startswith("fp16.qwerty:")
    assert "valid keys here:" in message
    assert "loss_scale_window" in message


def test_unknown_key_in_optimizer_params_depends_on_type():
    message = only_problem({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}})
    assert message.startswith("optimizer.params.momentum:")
    assert "unknown key 'momentum'" in message


def test_wrong_case_key_is_suggested():
    assert "did you mean 'train_batch_size'?" in only_problem({"Train_Batch_Size": 8, **STRICT})


def test_unknown_keys_can_be_downgraded_to_warnings(caplog):
    caplog.set_level(logging.WARNING)
    logger = logging.getLogger("zerotrain")
    logger.addHandler(caplog.handler)
    try:
        cfg = load_config({"train_batch_size": 8, "comms_config": {}}, unknown_keys="warn")
    finally:
        logger.removeHandler(caplog.handler)
    assert cfg.train_batch_size == 8
    assert "comms_config" in caplog.text
    assert "did you mean 'comms_logger'?" in caplog.text


# -- wrong types and values -----------------------------------------------------------------


def test_wrong_type_names_path_value_and_allowed():
    message = only_problem({"zero_optimization": {"stage": "two"}})
    assert message.startswith("zero_optimization.stage:")
    assert "got 'two'" in message
    assert "whole number" in message
    assert only_problem({"zero_optimization": {"stage": 4}}).endswith("allowed: a number <= 3")
    # Booleans are not numbers here, although Python says True == 1.
    assert "got True" in only_problem({"zero_optimization": {"stage": True}})


def test_out_of_range_value():
    message = only_problem({"train_batch_size": 0})
    assert message == "train_batch_size: got 0; allowed: a number >= 1"


def test_literal_choice():
    message = only_problem({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    assert message.startswith("zero_optimization.offload_optimizer.device:")
    assert "'cpu'" in message
    assert "'nvme'" in message


def test_string_is_not_a_boolean():
    message = only_problem({"fp16": {"enabled": "true"}})
    assert message == "fp16.enabled: got 'true'; allowed: true or false"


def test_integral_floats_are_integers_but_fractions_are_not():
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 5e8}})
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)
    message = only_problem({"train_batch_size": 2.5})
    assert "got 2.5" in message
    assert "whole number" in message


def test_optimizer_param_value_checked_against_type():
    message = only_problem({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}})
    assert message.startswith("optimizer.params.betas[1]:")
    assert "got 1.5" in message
    assert "< 1" in message


def test_unknown_optimizer_type_suggests_closest():
    message = only_problem({"optimizer": {"type": "Adamm"}})
    assert message == "optimizer.type: unknown optimizer type 'Adamm'; did you mean 'Adam'?"


def test_scheduler_type_is_case_insensitive_and_params_checked():
    cfg = load_config(
        {"optimizer": {"type": "sgd"}, "scheduler": {"type": "warmuplr", "params": {}}}
    )
    assert cfg.scheduler is not None
    assert cfg.scheduler.type == "WarmupLR"
    message = only_problem({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})
    assert message.startswith("scheduler.params.warmup_type:")
    assert "'log'" in message


def test_every_problem_is_reported_at_once():
    found = problems(
        {
            "zero_optimisation": {},
            "train_batch_size": -1,
            "fp16": {"enabled": 3},
            "wandb": 5,
            **STRICT,
        }
    )
    paths = sorted(p.split(":")[0] for p in found)
    assert paths == ["fp16.enabled", "train_batch_size", "wandb", "zero_optimisation"]


def test_bf16_rejects_loss_scaling():
    message = only_problem({"bf16": {"enabled": True, "loss_scale": 128.0}})
    assert message.startswith("bf16.loss_scale:")
    assert "only 1.0 is allowed" in message


def test_nvme_offload_needs_a_path():
    message = only_problem({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    assert "nvme_path is not set" in message


# -- legacy spellings and "auto" ------------------------------------------------------------


def test_legacy_aliases_are_rewritten():
    cfg = load_config(
        {
            "bfloat16": {"enabled": False},
            "zero_optimization": {
                "cpu_offload": True,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert any("bfloat16" in note for note in cfg.auto_notes)


def test_legacy_and_current_spelling_together_is_an_error():
    message = only_problem({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert message.startswith("bfloat16:")
    assert "keep one" in message


def test_offload_false_means_no_offload_and_true_is_rejected():
    cfg = load_config({"zero_optimization": {"offload_param": False}})
    assert cfg.zero_optimization.offload_param.device == "none"
    message = only_problem({"zero_optimization": {"offload_param": True}})
    assert 'give an object such as {"device": "cpu"}' in message


def test_auto_batch_sizes_are_derived_and_defaults_logged():
    cfg = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "fp16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        }
    )
    assert cfg.train_batch_size is None
    assert cfg.fp16.enabled is False
    notes = "\n".join(cfg.auto_notes)
    assert "train_batch_size" in notes
    assert "derived" in notes
    assert "optimizer.params.betas" in notes
    assert "(0.9, 0.999)" in notes
    assert cfg.scheduler is not None
    assert cfg.scheduler.params["warmup_max_lr"] == 1e-3
    assert to_policies(cfg, 2).training.batch.train_batch_size == 8


def test_auto_without_an_obvious_value_must_be_filled_in():
    found = problems(
        {"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    )
    assert len(found) == 2
    assert all('is "auto"' in p and "give a value" in p for p in found)
    assert {p.split(":")[0] for p in found} == {"gradient_clipping", "optimizer.params.lr"}


def test_max_grad_norm_in_optimizer_params_means_gradient_clipping():
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 2.0}}})
    assert cfg.gradient_clipping == 2.0
    message = only_problem(
        {"gradient_clipping": 1.0, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 2.0}}}
    )
    assert "keep only gradient_clipping" in message


# -- sources --------------------------------------------------------------------------------


def test_json_file_with_trailing_comma_loads_with_warning(tmp_path, caplog):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "steps_per_print": 5,\n}\n')
    logger = logging.getLogger("zerotrain")
    logger.addHandler(caplog.handler)
    try:
        cfg = load_config(str(path))
    finally:
        logger.removeHandler(caplog.handler)
    assert cfg.steps_per_print == 5
    assert "trailing comma" in caplog.text
    assert "line(s) 3" in caplog.text


def test_template_placeholder_is_named_with_its_position(tmp_path):
    path = tmp_path / "template.json"
    path.write_text('{\n  "curriculum_learning": {"min_difficulty": CONFIG_CL_MIN}\n}\n')
    message = only_problem(str(path))
    assert "line 2" in message
    assert "'CONFIG_CL_MIN'" in message
    assert "placeholder" in message


def test_malformed_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8 "steps_per_print": 1}')
    message = only_problem(str(path))
    assert "line 1, column" in message
    assert "Expecting ',' delimiter" in message


def test_duplicate_keys_are_rejected(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "appears twice" in only_problem(str(path))


def test_missing_file_is_named():
    assert "config file not found: /nonexistent/ds.json" in only_problem("/nonexistent/ds.json")


def test_config_path_from_command_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 12}))
    assert load_config(None, argv=["train.py", "--config", str(path)]).train_batch_size == 12
    assert load_config(None, argv=[f"--deepspeed_config={path}"]).train_batch_size == 12
    message = only_problem_argv([])
    assert "no config given" in message


def only_problem_argv(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, argv=argv)
    return str(info.value.problems[0])


# -- batch arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tbs", "mbs", "gas", "world", "expected"),
    [
        (32, 4, 2, 4, (32, 4, 2)),
        (32, 4, None, 4, (32, 4, 2)),
        (32, None, 2, 4, (32, 4, 2)),
        (None, 4, 2, 4, (32, 4, 2)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 4, None, 3, (12, 4, 1)),
    ],
)
def test_any_two_batch_sizes_determine_the_third(tbs, mbs, gas, world, expected):
    got = resolve_batch_sizes(tbs, mbs, gas, world)
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == expected


def test_inconsistent_batch_sizes_show_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(64, 4, 2, 4)
    assert str(info.value.problems[0]) == (
        "train_batch_size: train_batch_size (64) != train_micro_batch_size_per_gpu (4) x "
        "gradient_accumulation_steps (2) x data-parallel world size (4) = 32"
    )


def test_indivisible_batch_size_shows_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(30, 4, None, 2)
    assert "train_batch_size (30) is not a multiple of" in str(info.value)
    assert "= 8" in str(info.value)


def test_batch_size_needs_at_least_one_of_two_keys():
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(None, None, 4, 2)
    with pytest.raises(ConfigError, match="no batch size given"):
        resolve_batch_sizes(None, None, None, 2)


# -- features -------------------------------------------------------------------------------


def test_enabled_unbuilt_features_are_listed_by_key():
    cfg = load_config(
        {
            "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
            "optimizer": {"type": "Lion", "params": {"lr": 1e-4}},
        }
    )
    found = "\n".join(not_implemented(cfg))
    for key in (
        "fp16.fp16_master_weights_and_grads=true",
        "optimizer.type=lion with offload: the offloaded step runs adam or adamw",
        "optimizer.type=Lion",
    ):
        assert key in found


def test_offload_needs_partitioned_states_and_adam():
    at_stage_0 = load_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "at stage 0: offload steps partitioned optimizer states" in "\n".join(
        not_implemented(at_stage_0)
    )
    sgd = load_config(
        {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        }
    )
    assert "optimizer.type=sgd with offload" in "\n".join(not_implemented(sgd))
    fine = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        }
    )
    assert not_implemented(fine) == []


def test_offload_param_below_stage_3_is_noted():
    cfg = load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert any("offload_param acts only at stage 3" in n for n in inert_keys(cfg))


def test_disabled_sections_are_not_reported():
    cfg = load_config({"fp16": {"enabled": False}, "data_efficiency": {"enabled": False}})
    assert not_implemented(cfg) == []


def test_keys_without_effect_are_noted():
    cfg = load_config(
        {
            "zero_optimization": {"stage": 0, "stage3_max_live_parameters": 1e9},
            "zero_allow_untested_optimizer": True,
        }
    )
    notes = "\n".join(inert_keys(cfg))
    assert "stage3_max_live_parameters acts only at stage >= 3" in notes
    assert "zero_allow_untested_optimizer" in notes


def test_initialize_refuses_unbuilt_features_before_touching_the_model():
    import torch

    import zerotrain

    with pytest.raises(NotImplementedError, match=r"dump_state"):
        zerotrain.initialize(
            model=torch.nn.Linear(2, 2),
            config={"train_batch_size": 2, "dump_state": True},
        )
    assert not torch.distributed.is_initialized()  # refused before joining a group


def test_misspelt_key_set_to_auto_is_still_unknown():
    message = only_problem({"gradient_acumulation_steps": "auto", **STRICT})
    assert "did you mean 'gradient_accumulation_steps'?" in message
    message = only_problem({"optimizer": {"type": "AdamW", "params": {"weight_decya": "auto"}}})
    assert message.startswith("optimizer.params.weight_decya:")


def test_auto_stage_must_be_filled_in():
    assert 'is "auto"' in only_problem({"zero_optimization": {"stage": "auto"}})


@pytest.mark.parametrize(
    ("config", "path", "allowed"),
    [
        (
            {"optimizer": {"type": "SGD", "params": {"momentum": 1.5}}},
            "optimizer.params.momentum",
            "<= 1",
        ),
        (
            {
                "optimizer": {"type": "Adam"},
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 10, "cos_min_ratio": 3},
                },
            },
            "scheduler.params.cos_min_ratio",
            "<= 1",
        ),
        (
            {
                "optimizer": {"type": "Adam"},
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {"total_num_steps": 10, "warmup_num_steps": 100},
                },
            },
            "scheduler.params",
            "the decay would never start",
        ),
    ],
)
def test_hyperparameter_ranges(config, path, allowed):
    message = only_problem(config)
    assert message.startswith(path + ":")
    assert allowed in message


def test_errors_say_a_path_came_from_the_command_line(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("n_layers: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(None, argv=["--config", str(path)])
    assert "from --config on the command line" in str(info.value)


def test_grid_sizes_come_from_the_config_and_unimplemented_axes_are_refused_by_name():
    from zerotrain.config.features import pipeline_stages, tensor_parallel_size

    plain = load_config({"train_batch_size": 2})
    assert (pipeline_stages(plain), tensor_parallel_size(plain), plain.sequence_parallel_size) == (
        1,
        1,
        1,
    )
    grid = load_config(
        {
            "train_batch_size": 2,
            "sequence_parallel_size": 2,
            "tensor_parallel": {"autotp_size": 2},
            "pipeline": {"stages": 4},
        }
    )
    assert (pipeline_stages(grid), tensor_parallel_size(grid), grid.sequence_parallel_size) == (
        4,
        2,
        2,
    )
    found = "\n".join(not_implemented(grid))
    assert "sequence" not in found  # runs (initialize routes the model's attention)
    assert "tensor_parallel" not in found  # runs (initialize finds the plan)
    assert "pipeline" not in found  # runs (with a PipelineModule; initialize checks that)
    assert only_problem({"train_batch_size": 2, "pipeline": {"stages": 0}}) == (
        'pipeline.stages: got 0; allowed: a whole number >= 1, or "auto" (the PipelineModule\'s '
        "count)"
    )
    assert "got 'two'" in only_problem({"train_batch_size": 2, "pipeline": {"stages": "two"}})
    assert "got True" in only_problem({"train_batch_size": 2, "pipeline": {"stages": True}})
    assert pipeline_stages(load_config({"train_batch_size": 2, "pipeline": {"stages": 2.0}})) == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        load_config({"train_batch_size": 2, "sequence_parallel_size": 0})


# -- pipeline -------------------------------------------------------------------------------


def test_pipeline_section_defaults_and_good_values():
    from zerotrain.config.features import pipeline_stages
    from zerotrain.config.policies import PipelinePolicy

    default = load_config({"train_batch_size": 8, "pipeline": {}})
    assert pipeline_stages(default) == 1  # "auto": the PipelineModule decides
    assert default.pipeline.stages == "auto"
    assert to_policies(default, 1).pipeline == PipelinePolicy()
    assert to_policies(load_config({"train_batch_size": 8}), 1).pipeline == PipelinePolicy()

    cfg = load_config(
        {
            "train_batch_size": 8,
            "pipeline": {
                "stages": 4,
                "partition": "type:Block",
                "seed_layers": True,
                "activation_checkpoint_interval": 2,
                "schedule": "interleaved",
                "virtual_stages": 2,
                "grad_reduce": "per_microbatch",
                "reshard_after_forward": False,
            },
        }
    )
    assert pipeline_stages(cfg) == 4
    assert to_policies(cfg, 2).pipeline == PipelinePolicy(
        stages=4,
        partition_method="type:Block",
        seed_layers=True,
        activation_checkpoint_interval=2,
        schedule="interleaved",
        virtual_stages=2,
        grad_reduce="per_microbatch",
        reshard_after_forward=False,
    )


def test_pipeline_best_partition_means_parameters_and_auto_stages_stay_auto():
    cfg = load_config({"train_batch_size": 8, "pipeline": {"stages": "auto", "partition": "best"}})
    policy = to_policies(cfg, 1).pipeline
    assert (policy.stages, policy.partition_method) == (None, "parameters")
    assert not any("pipeline.stages" in note for note in cfg.auto_notes)
    assert (
        to_policies(
            load_config({"train_batch_size": 8, "pipeline": {"partition": "Uniform"}}), 1
        ).pipeline.partition_method
        == "uniform"
    )


def test_pipeline_deepspeed_partitioning_flags_are_accepted_and_noted():
    cfg = load_config(
        {"train_batch_size": 8, "pipeline": {"pipe_partitioned": False, "grad_partitioned": True}}
    )
    notes = "\n".join(inert_keys(cfg))
    assert "pipeline.pipe_partitioned" in notes
    assert "pipeline.grad_partitioned" in notes


def test_pipeline_unknown_key_suggests_closest():
    message = only_problem({"train_batch_size": 8, "pipeline": {"virtual_stage": 2}})
    assert message.startswith("pipeline.virtual_stage:")
    assert "did you mean 'virtual_stages'?" in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("schedule", "1F1B-interleaved", ("'1f1b'", "'gpipe'", "'interleaved'", "'zb-h1'")),
        ("grad_reduce", "per_step", ("'per_microbatch'", "'end_of_step'")),
        ("partition", "profile", ("parameters", "uniform", "type:REGEX", "best")),
    ],
)
def test_pipeline_wrong_choice_lists_the_allowed_values(key, value, allowed):
    message = only_problem({"train_batch_size": 8, "pipeline": {key: value}})
    assert message.startswith(f"pipeline.{key}:")
    assert repr(value) in message
    for choice in allowed:
        assert choice in message


def test_pipeline_virtual_stages_need_the_interleaved_schedule():
    message = only_problem({"train_batch_size": 8, "pipeline": {"virtual_stages": 2}})
    assert message.startswith("pipeline")
    assert 'needs schedule "interleaved"' in message
    assert "virtual_stages >= 2" in only_problem(
        {"train_batch_size": 8, "pipeline": {"schedule": "interleaved"}}
    )
    assert "invalid regex" in only_problem(
        {"train_batch_size": 8, "pipeline": {"partition": "type:("}}
    )


# -- the 1-bit optimizers ------------------------------------------------------------------------


def _one_bit_params(optimizer: dict) -> dict:
    cfg = load_config({"train_batch_size": 8, "optimizer": optimizer})
    spec = to_policies(cfg, 2).optimizer
    assert spec is not None
    return dict(spec.params)


def test_one_bit_optimizers_take_deepspeeds_parameters_and_defaults():
    params = _one_bit_params({"type": "OneBitAdam", "params": {"lr": 4e-4}})
    assert (params["freeze_step"], params["comm_backend_name"], params["cuda_aware"]) == (
        100000,
        "nccl",
        False,
    )
    zero_one = _one_bit_params({"type": "ZeroOneAdam"})
    assert (
        zero_one["var_freeze_step"],
        zero_one["var_update_scaler"],
        zero_one["local_step_scaler"],
        zero_one["local_step_clipper"],
    ) == (100000, 16, 32678, 16)
    lamb = _one_bit_params({"type": "onebitlamb"})
    assert (lamb["max_coeff"], lamb["min_coeff"], lamb["coeff_beta"]) == (10.0, 0.01, 0.9)
    assert (lamb["factor_max"], lamb["factor_min"], lamb["factor_threshold"]) == (4.0, 0.5, 0.1)


@pytest.mark.parametrize(
    ("optimizer", "params", "needles"),
    [
        ("OneBitAdam", {"freeze_steps": 10}, ("freeze_steps", "did you mean 'freeze_step'?")),
        ("OneBitAdam", {"amsgrad": True}, ("amsgrad is not supported",)),
        ("ZeroOneAdam", {"comm_backend_name": "gloo"}, ("comm_backend_name", "'nccl'")),
        ("ZeroOneAdam", {"var_update_scaler": 0}, ("var_update_scaler",)),
        ("OneBitLamb", {"factor_min": 3, "factor_max": 2}, ("factor_min (3.0) exceeds",)),
    ],
)
def test_one_bit_optimizer_params_are_checked(optimizer, params, needles):
    message = only_problem({"optimizer": {"type": optimizer, "params": params}})
    for needle in needles:
        assert needle in message, message

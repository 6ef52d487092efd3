"""The elastic batch plan against DeepSpeed 0.19.5's ``compute_elastic_config``.

The expected values below are what DeepSpeed 0.19.5 returned for these configs (its
``deepspeed/elasticity/elasticity.py`` run on this machine; the first case is also DeepSpeed's
own unit test: 9792 and 23 world sizes). A sweep of 3877 random configs gave the same
batch, world sizes and micro-batch in all 1918 where DeepSpeed's answer was usable; where it
was not (no valid world size, a batch of 0, a crash) zerotrain raises an error saying why,
except that version 0.2 with ``prefer_larger_batch: false`` falls back to the current world
size's own batch as DeepSpeed does with ``true`` (DeepSpeed crashes there).
"""

from __future__ import annotations

import json
import logging

import pytest

import zerotrain
from zerotrain.cli.main import main as cli_main
from zerotrain.config.elastic_batch import (
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    ElasticOptions,
    micro_batch_for,
    plan_elastic_batch,
)
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.config.policies import to_policies

# (elasticity section, world size) -> (train_batch_size, valid world sizes, micro-batch)
DEEPSPEED_0_19_5 = [
    (
        {"max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
         "max_gpus": 1500, "version": 0.1},
        0,
        (9792, [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288,
                306, 408, 576, 612, 816, 1224], None),
    ),
    (
        {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1},
        0,
        (1680, [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60,
                70, 84, 105, 120, 140, 168, 210, 280, 420, 840], None),
    ),
    (
        {"max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
         "version": 0.1},
        3,
        (48, [1, 2, 3, 4], 4),
    ),
    (
        {"max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
         "max_gpus": 1500, "version": 0.2, "num_gpus_per_node": 8},
        64,
        (7680, [32, 40, 48, 64, 80, 96, 120, 128, 160, 192, 240, 320, 480, 640, 960], 12),
    ),
    (
        {"max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 2, "max_gpus": 4,
         "version": 0.2, "num_gpus_per_node": 2},
        2,
        (48, [2, 4], 4),
    ),
    (  # 3 ranks is no valid node count: its own batch (version 0.2's fallback)
        {"max_train_batch_size": 1000, "micro_batch_sizes": [24, 28], "min_gpus": 32,
         "max_gpus": 64, "num_gpus_per_node": 4, "version": 0.2},
        3,
        (936, [3], 24),
    ),
    (
        {"max_train_batch_size": 4096, "micro_batch_sizes": [4, 8], "min_gpus": 8,
         "max_gpus": 64, "num_gpus_per_node": 8, "model_parallel_size": 2, "version": 0.2},
        16,
        (3840, [4, 8, 12, 16, 20, 24, 32], 8),
    ),
]  # fmt: skip


def _options(section: dict) -> ElasticOptions:
    cfg = load_config({"elasticity": {"enabled": True, **section}}).elasticity
    assert cfg is not None
    return cfg.options()


@pytest.mark.parametrize(("section", "world", "expected"), DEEPSPEED_0_19_5)
def test_plan_equals_deepspeeds(section, world, expected):
    plan = plan_elastic_batch(_options(section), world)
    assert (plan.train_batch_size, list(plan.valid_world_sizes), plan.micro_batch_size) == expected
    # The DeepSpeed API gives the same.
    got = zerotrain.elasticity.compute_elastic_config(
        {"elasticity": {"enabled": True, **section}}, "0.19.5", world_size=world
    )
    assert list(got[:2]) == [expected[0], expected[1]]


@pytest.mark.parametrize(("section", "world", "expected"), DEEPSPEED_0_19_5[:3])
def test_every_valid_world_size_splits_the_batch_exactly(section, world, expected):
    opts = _options(section)
    plan = plan_elastic_batch(opts, world)
    for size in plan.valid_world_sizes:
        micro = micro_batch_for(plan.train_batch_size, size, opts)
        assert micro in opts.micro_batch_sizes
        assert plan.train_batch_size % (micro * size) == 0


def test_unusable_plans_are_errors_that_say_why():
    with pytest.raises(ElasticityError, match="exceed max_train_batch_size"):
        plan_elastic_batch(ElasticOptions(4, (8,), version=0.1))
    with pytest.raises(ElasticityError, match="no world size in"):
        plan_elastic_batch(ElasticOptions(256, (25,), min_gpus=32, max_gpus=64, version=0.1))
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"valid world sizes: \[1, 2, 3, 4\]"):
        plan_elastic_batch(_options(DEEPSPEED_0_19_5[2][0]), 5)
    with pytest.raises(ElasticityError, match="give one"):
        plan_elastic_batch(ElasticOptions(64, (2,), version=0.2))
    with pytest.raises(ElasticityError, match="does not support model parallelism"):
        plan_elastic_batch(ElasticOptions(64, (2,), model_parallel_size=2, version=0.1))
    with pytest.raises(ElasticityError, match="multiple of model_parallel_size"):
        plan_elastic_batch(ElasticOptions(64, (2,), num_gpus_per_node=3, model_parallel_size=2), 6)


def test_section_checks_what_deepspeed_checks():
    with pytest.raises(ConfigError, match="needs max_train_batch_size and micro_batch_sizes"):
        load_config({"elasticity": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"min_gpus \(8\) cannot be greater than max_gpus \(4\)"):
        load_config(
            {"elasticity": {"enabled": True, "max_train_batch_size": 8,
                            "micro_batch_sizes": [2], "min_gpus": 8, "max_gpus": 4}}
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"version 0\.3 is not supported"):
        load_config({"elasticity": {"version": 0.3}})
    with pytest.raises(ConfigError, match="micro_batch_sizes"):
        load_config({"elasticity": {"micro_batch_sizes": [0]}})
    # A disabled section with placeholders is fine (DeepSpeed never reads it).
    assert load_config({"train_batch_size": 4, "elasticity": {"enabled": False}}) is not None


ELASTIC = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4],
           "min_gpus": 1, "max_gpus": 4, "version": 0.1}  # fmt: skip


@pytest.mark.parametrize(("world", "gas"), [(1, 12), (2, 6), (3, 4), (4, 3)])
def test_initialize_takes_the_batch_from_the_plan(world, gas):
    batch = to_policies(load_config({"elasticity": ELASTIC}), world).training.batch
    assert (batch.train_batch_size, batch.micro_batch_size) == (48, 4)
    assert batch.gradient_accumulation_steps == gas


def test_batch_keys_beside_elasticity_are_refused_unless_ignored(caplog):
    with pytest.raises(ConfigError, match="ignore_non_elastic_batch_info"):
        to_policies(load_config({"train_batch_size": 8, "elasticity": ELASTIC}), 2)
    loose = {**ELASTIC, "ignore_non_elastic_batch_info": True}
    with caplog.at_level(logging.WARNING):
        batch = to_policies(load_config({"train_batch_size": 8, "elasticity": loose}), 2)
    assert batch.training.batch.train_batch_size == 48
    assert "elasticity overrides train_batch_size: 8 -> 48" in caplog.text
    with pytest.raises(ConfigError, match=r"world size 5 is not valid.*\[1, 2, 3, 4\]"):
        to_policies(load_config({"elasticity": ELASTIC}), 5)


def test_elastic_plan_command(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"elasticity": ELASTIC}))
    assert cli_main(["elastic-plan", "-c", str(path), "-w", "2"]) == 0
    out = capsys.readouterr().out
    assert "global batch (train_batch_size): 48" in out
    assert "valid data-parallel world sizes: [1, 2, 3, 4]" in out
    assert "         2 |           4 |                  6  <- this job" in out
    path.write_text(json.dumps({"elasticity": {**ELASTIC, "enabled": False}}))
    assert cli_main(["elastic-plan", "-c", str(path)]) == 2
    assert "no enabled 'elasticity' section" in capsys.readouterr().err

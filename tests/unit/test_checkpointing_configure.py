"""DeepSpeed's ``checkpointing.configure(mpu_, deepspeed_config, ...)`` and
``is_configured()``, beside zerotrain's keyword spelling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotrain import checkpointing
from zerotrain.config.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean():
    checkpointing.reset()
    yield
    checkpointing.reset()


def test_not_configured_until_configure_is_called() -> None:
    assert not checkpointing.is_configured()
    checkpointing.configure(None)
    assert checkpointing.is_configured()
    checkpointing.reset()
    assert not checkpointing.is_configured()


def test_deepspeed_spelling_starts_from_the_defaults_each_time() -> None:
    checkpointing.configure(None, checkpoint_in_cpu=True, num_checkpoints=4, profile=True)
    policy = checkpointing.current()
    assert policy.cpu_checkpointing
    assert policy.number_checkpoints == 4
    assert policy.profile
    # DeepSpeed resets before applying: what this call leaves out is back to its default.
    policy = checkpointing.configure(None, synchronize=True)
    assert policy.synchronize
    assert not policy.cpu_checkpointing
    assert policy.number_checkpoints is None


def test_keyword_spelling_still_changes_only_what_it_names() -> None:
    checkpointing.configure(cpu_checkpointing=True)
    policy = checkpointing.configure(number_checkpoints=3)
    assert policy.cpu_checkpointing
    assert policy.number_checkpoints == 3


@pytest.mark.parametrize("as_path", [False, True])
def test_deepspeed_config_section_then_arguments_override(tmp_path: Path, as_path: bool) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "activation_checkpointing": {
            "partition_activations": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 6,
            "profile": True,
        },
    }
    source: object = config
    if as_path:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(config))
        source = str(path)
    policy = checkpointing.configure(None, deepspeed_config=source, profile=False)
    assert policy.partition_activations
    assert policy.contiguous_memory
    assert policy.number_checkpoints == 6
    assert not policy.profile  # the argument wins over the file, as in DeepSpeed


def test_config_without_the_section_gives_the_defaults() -> None:
    checkpointing.configure(cpu_checkpointing=True)
    policy = checkpointing.configure(None, {"train_micro_batch_size_per_gpu": 1})
    assert policy == checkpointing.CheckpointingContext().policy


def test_bad_config_and_bad_mpu_are_refused() -> None:
    with pytest.raises(ConfigError):
        checkpointing.configure(None, {"activation_checkpointing": {"partition_activation": 1}})
    with pytest.raises(TypeError, match="get_tensor_model_parallel_group"):
        checkpointing.configure(object())
    with pytest.raises(TypeError, match="unknown option"):
        checkpointing.configure(cpu_offload=True)

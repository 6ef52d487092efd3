"""DeepSpeed's script-level names, used the way DeepSpeed documents them
(``import zerotrain as deepspeed``): the argument group, ``initialize(args=...)``,
``RepeatingLoader``, ``set_random_seed``."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zerotrain as deepspeed
from zerotrain.engine.initialize import _config_from_args


def test_add_config_arguments_adds_deepspeeds_group():
    parser = argparse.ArgumentParser(description="My training script")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds_config.json"])
    assert args.deepspeed is True
    assert args.deepspeed_config == "ds_config.json"
    assert args.deepscale is False
    assert args.deepscale_config is None
    defaults = parser.parse_args([])
    assert defaults.deepspeed is False
    assert defaults.deepspeed_config is None
    groups = [g.title for g in parser._action_groups]
    assert "DeepSpeed" in groups


def test_initialize_reads_the_config_from_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert _config_from_args(None, None, args) == str(path)
    old = parser.parse_args(["--deepscale_config", str(path)])
    assert _config_from_args(None, None, old) == str(path)  # deprecated name, warned
    with pytest.raises(ValueError, match=r"both as an argument and in args\.deepspeed_config"):
        _config_from_args({"train_batch_size": 2}, None, args)
    both = parser.parse_args(["--deepspeed_config", "a.json", "--deepscale_config", "b.json"])
    with pytest.raises(ValueError, match=r"only --deepspeed_config"):
        _config_from_args(None, None, both)


def test_repeating_loader_restarts_and_reshuffles_each_epoch():
    data = TensorDataset(torch.arange(6))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    repeating = deepspeed.utils.RepeatingLoader(loader)
    assert iter(repeating) is repeating
    seen = [next(repeating)[0].tolist() for _ in range(9)]  # 3 batches an epoch, 3 epochs
    epochs = [[i for batch in seen[e : e + 3] for i in batch] for e in (0, 3, 6)]
    assert [sorted(e) for e in epochs] == [[0, 1, 2, 3, 4, 5]] * 3  # each epoch: everything
    assert epochs[0] != epochs[1]  # and set_epoch reshuffled it
    assert repeating.epoch == 2
    plain = deepspeed.runtime.dataloader.RepeatingLoader([1, 2])
    assert [next(plain) for _ in range(5)] == [1, 2, 1, 2, 1]


def test_set_random_seed_seeds_python_numpy_and_torch():
    from zerotrain.runtime.utils import set_random_seed

    draws = []
    for _ in range(2):
        set_random_seed(2**70 + 5)  # larger than numpy and torch accept: reduced as DeepSpeed
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    deepspeed.runtime.utils.set_random_seed(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected

"""The world-level manifest merge (checkpoint/merge.py), without processes: every rank of a
grid writes an index, global rank 0 merges them. Two pipeline stages holding different
layers give one model table with both; a buffer written by both tensor ranks is kept once;
ranks disagreeing on a tensor's shape are named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.manifest import read_manifest
from zerotrain.checkpoint.merge import index_file, merge_indexes, write_index
from zerotrain.checkpoint.plan import ShardPlan
from zerotrain.checkpoint.regions import Span
from zerotrain.checkpoint.state import Counters, Placement, TrainState
from zerotrain.parallel.topology import Topology


class _State:
    """Just what the merge reads of a TrainState."""

    def __init__(self, topology: Topology) -> None:
        self.placement = Placement(0, topology, None, None, torch.device("cpu"))  # type: ignore[arg-type]
        self.optimizer = None
        self.lr_scheduler = None
        self.loss_scaler = None
        self.data_loader = None
        self.stage = 3
        self.compute_dtype = None

    def counters(self) -> Counters:
        return Counters(7, 56, 7, 0)


def _index(partial: Path, rank: int, tensors: dict[str, list[int]]) -> None:
    plan = ShardPlan(f"rank{rank:05d}.safetensors", {n: tuple(s) for n, s in tensors.items()})
    for name, shape in tensors.items():
        numel = int(torch.tensor(shape).prod())
        plan.add(f"{name}.param", torch.zeros(numel), "param", [Span(name, 0, numel, 0)])
    table = {
        n: {"kind": "param", "shape": s, "dtype": "fp32", "trainable": True}
        for n, s in tensors.items()
    }
    write_index(partial, rank, plan, 0, 0, {"python": rank}, table, {})


def test_pipeline_stages_give_the_union_and_replicas_are_kept_once(tmp_path: Path) -> None:
    # pipe=2 x tensor=2: ranks 0-1 are stage 0 (embedding + a shared norm), 2-3 stage 1.
    topology = Topology(pipe=2, tensor=2)
    stage0 = {"wte.weight": [16, 4], "norm.weight": [4]}
    stage1 = {"head.weight": [16, 4], "norm.weight": [4]}
    for rank in range(4):
        _index(tmp_path, rank, stage0 if rank < 2 else stage1)
    checksum = merge_indexes(cast(TrainState, _State(topology)), tmp_path, "t", False)
    manifest = read_manifest(tmp_path)
    assert manifest.checksum == checksum
    assert list(manifest.tensors) == ["wte.weight", "norm.weight", "head.weight"]
    assert manifest.topology.pipe == 2
    assert manifest.topology.tensor == 2
    assert manifest.world_size == 4
    assert len(manifest.rng) == 4
    assert sorted(manifest.files) == [f"rank{r:05d}.safetensors" for r in range(4)]
    per_name: dict[str, int] = {}
    for fragment in manifest.fragments:
        per_name[fragment.name] = per_name.get(fragment.name, 0) + 1
    assert per_name == {"wte.weight": 1, "norm.weight": 1, "head.weight": 1}
    assert not any(p.name.endswith(".index.json") for p in tmp_path.iterdir())


def test_ranks_disagreeing_on_a_shape_are_named(tmp_path: Path) -> None:
    _index(tmp_path, 0, {"w": [4, 4]})
    _index(tmp_path, 1, {"w": [4, 8]})
    with pytest.raises(
        CheckpointError, match=r"tensor 'w': rank 0 has .*\[4, 4\].* rank 1 has .*\[4, 8\]"
    ):
        merge_indexes(cast(TrainState, _State(Topology(pipe=2))), tmp_path, "t", False)


def test_indexes_hold_regions_of_the_global_tensor(tmp_path: Path) -> None:
    _index(tmp_path, 0, {"w": [3, 5]})
    index: dict[str, Any] = json.loads((tmp_path / index_file(0)).read_text())
    assert index["fragments"][0] == {
        "kind": "param",
        "shape": [3, 5],
        "name": "w",
        "offsets": [0, 0],
        "lengths": [3, 5],
        "lo": 0,
        "hi": 15,
        "file": "rank00000.safetensors",
        "key": "w.param",
        "offset": 0,
    }

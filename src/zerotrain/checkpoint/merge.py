"""Each rank's index of what it wrote, and their merge into the one manifest of the job.

Every rank of the job (all pipeline stages, tensor and data ranks) writes an index beside its
shard file; global rank 0 merges them: the model table is the union of what every rank holds
(a pipeline stage holds only its layers), fragments replicated on several ranks (a buffer on
every tensor rank) are kept once, random states are listed by global rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.directory import shard_file
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.manifest import (
    CLIENT_STATE,
    FORMAT,
    FORMAT_VERSION,
    FileInfo,
    write_json_atomically,
    write_manifest,
)
from zerotrain.checkpoint.plan import ShardPlan
from zerotrain.checkpoint.safetensors_io import file_crc32
from zerotrain.checkpoint.state import TrainState
from zerotrain.config.policies import short_dtype_name
from zerotrain.optim.base import GROUP_LAYOUT_KEYS


def index_file(rank: int) -> str:
    """Name of global rank ``rank``'s index (merged into the manifest, then removed)."""
    return f"{shard_file(rank)}.index.json"


def write_index(
    partial: Path,
    rank: int,
    plan: ShardPlan,
    size: int,
    crc: int,
    rng_state: dict[str, Any],
    tensors: dict[str, Any],
    aliases: dict[str, str],
    local: dict[str, Any] | None = None,
    members: list[list[str]] | None = None,
) -> None:
    """Write global rank ``rank``'s index into the checkpoint being saved (``local``: its
    rank-local optimizer state's fingerprint and keys, ``checkpoint/rank_local.py``;
    ``members``: the parameters of each optimizer group it holds)."""
    index = {
        "rank": rank,
        "file": plan.file,
        "bytes": size,
        "crc32": crc,
        "fragments": plan.fragments,
        "scalars": plan.scalars,
        "rng": rng_state,
        "local": local,
        "tensors": tensors,
        "aliases": aliases,
        "members": members,
    }
    write_json_atomically(partial / index_file(rank), index)


def to_json(value: Any, where: str) -> Any:
    """``value`` as plain JSON (tuples become lists, 0-d tensors numbers), else an error
    naming where the unsupported value is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
        return {str(k): to_json(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {where} ({type(value).__name__}) in the checkpoint manifest: only "
        "numbers, strings, lists and dicts of them are supported"
    )


def _union(
    merged: dict[str, Any], mine: dict[str, Any], owner: dict[str, int], rank: int, what: str
) -> None:
    for name, info in mine.items():
        if name not in merged:
            merged[name], owner[name] = info, rank
        elif merged[name] != info:
            raise CheckpointError(
                f"{what} '{name}': rank {owner[name]} has {merged[name]}, rank {rank} has "
                f"{info}; every rank holding a tensor must agree on its global shape and dtype"
            )


def _fragment_key(f: dict[str, Any]) -> tuple[Any, ...]:
    return (f["kind"], f["name"], tuple(f["offsets"]), tuple(f["lengths"]), f["lo"], f["hi"])


def merge_indexes(state: TrainState, partial: Path, tag: str, has_client_state: bool) -> str:
    """Global rank 0: merge every rank's index into ``manifest.json``; returns its checksum."""
    placement = state.placement
    topology = placement.topology
    files: dict[str, Any] = {}
    fragments: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    scalars: list[dict[str, Any]] = []
    rng_states: list[dict[str, Any]] = []
    local_states: list[dict[str, Any] | None] = []
    tensors: dict[str, Any] = {}
    aliases: dict[str, Any] = {}
    owners: dict[str, int] = {}
    alias_owners: dict[str, int] = {}
    members: list[list[str]] = []
    for rank in range(topology.world_size):
        path = partial / index_file(rank)
        index = json.loads(path.read_text())
        files[index["file"]] = {"bytes": index["bytes"], "crc32": index["crc32"]}
        for fragment in index["fragments"]:
            if (key := _fragment_key(fragment)) not in seen:
                seen.add(key)
                fragments.append(fragment)
        scalars += index["scalars"]
        rng_states.append(index["rng"])
        local_states.append(index.get("local"))
        _union(tensors, index["tensors"], owners, rank, "tensor")
        _union(aliases, index["aliases"], alias_owners, rank, "alias")
        for group, names in enumerate(index.get("members") or []):
            while len(members) <= group:
                members.append([])
            members[group] += [n for n in names if n not in members[group]]
    if has_client_state:
        client = partial / CLIENT_STATE
        info = FileInfo(bytes=client.stat().st_size, crc32=file_crc32(client))
        files[CLIENT_STATE] = info.model_dump()
    counters = state.counters()
    optimizer = state.optimizer
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.time(),
        "topology": {
            "pipe": topology.pipe,
            "data": topology.data,
            "tensor": topology.tensor,
            "sequence": topology.sequence,
            "order": list(topology.order),
        },
        "world_size": topology.world_size,
        "stage": state.stage,
        "compute_dtype": short_dtype_name(state.compute_dtype)
        if state.compute_dtype is not None
        else None,
        "global_steps": counters.global_steps,
        "global_samples": counters.global_samples,
        "micro_steps": counters.micro_steps,
        "skipped_steps": counters.skipped_steps,
        "tensors": tensors,
        "aliases": aliases,
        "files": files,
        "fragments": fragments,
        "optimizer": None
        if optimizer is None
        else {
            "type": type(optimizer).__name__,
            "groups": [
                to_json(
                    {k: v for k, v in g.items() if k not in GROUP_LAYOUT_KEYS},
                    f"param group {i}",
                )
                for i, g in enumerate(optimizer.param_groups)
            ],
            "scalars": scalars,
            "members": members,
        },
        "scheduler": to_json(state.lr_scheduler.state_dict(), "the lr scheduler's state")
        if state.lr_scheduler is not None
        else None,
        "loss_scaler": state.loss_scaler.state_dict() if state.loss_scaler is not None else None,
        "data": to_json(state.data_loader.state_dict(), "the data loader's state")
        if state.data_loader is not None
        else None,
        "rng": rng_states,
        "rank_local": local_states if any(e is not None for e in local_states) else None,
        "client_state": CLIENT_STATE if has_client_state else None,
    }
    checksum = write_manifest(partial, manifest)
    for rank in range(topology.world_size):
        (partial / index_file(rank)).unlink()
    return checksum

"""A zerotrain checkpoint written as a DeepSpeed universal checkpoint, for going back.

DeepSpeed loads a universal checkpoint (its ``ds_to_universal`` format) at any data-parallel
world size and ZeRO stage 1-3 when its config says ``"checkpoint": {"load_universal": true}``:
every parameter whole under ``TAG/zero/NAME/`` (``fp32.pt``, one file per optimizer state,
``step.pt``), the optimizer's global state in ``TAG/zero/optimizer_state.pt`` and the
counters, schedule and client state in the model-states file. That is what is written here,
one tensor at a time (memory: the largest tensor, not the model). DeepSpeed reads its own
``latest_universal`` pointer; ``latest`` is written too, for tools that read it.

DeepSpeed's universal loading restores the trainable parameters and their optimizer states;
it restores no buffers (they are saved here anyway, as ``ds_to_universal`` saves them) and
needs a ZeRO stage of 1 or more (a DeepSpeed job without ZeRO loads the module only).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.deepspeed_import import GROUP_SETTINGS
from zerotrain.checkpoint.errors import IncompatibleCheckpointError
from zerotrain.checkpoint.manifest import scalar_by_name, write_text_atomically
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

#: The DeepSpeed version whose layout is written (its loaders check the field).
DEEPSPEED_LAYOUT_VERSION = "0.19.8"
_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _save(value: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(value, tmp)
    os.replace(tmp, path)


def export_deepspeed_universal(
    load_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    out_tag: str | None = None,
) -> Path:
    """Write zerotrain checkpoint ``tag`` of ``load_dir`` (default: the latest) as a
    DeepSpeed universal checkpoint ``out_dir/OUT_TAG`` (default: ``global_stepN_universal``);
    returns its path.

    Raises:
        CheckpointError: the checkpoint is missing or corrupt (every file is verified first).
        IncompatibleCheckpointError: it holds no optimizer states (a weights-only save), or
            tensor-parallel parameters (DeepSpeed's universal loading of those needs their
            partitioning patterns, which zerotrain does not write).
    """
    reader = CheckpointReader.open(load_dir, tag)
    reader.verify()
    manifest = reader.manifest
    if manifest.optimizer is None:
        raise IncompatibleCheckpointError(
            f"{reader.path} was saved without optimizer states; DeepSpeed's universal "
            "checkpoints carry them. Export the weights with `zerotrain consolidate` instead"
        )
    if manifest.topology.tensor > 1:
        raise IncompatibleCheckpointError(
            f"{reader.path} was saved with tensor parallelism {manifest.topology.tensor}; "
            "exporting it to DeepSpeed is not supported (only data-parallel jobs, any ZeRO stage)"
        )
    out_tag = out_tag or f"global_step{manifest.global_steps}_universal"
    root = Path(out_dir)
    target = root / out_tag
    (target / "zero").mkdir(parents=True, exist_ok=True)
    states = sorted(k.removeprefix("optim.") for k in reader.kinds() if k.startswith("optim."))
    steps = scalar_by_name(manifest.optimizer, "step")
    trainable = [n for n, t in manifest.tensors.items() if t.kind == "param" and t.trainable]
    for name in trainable:
        folder = target / "zero" / name
        folder.mkdir(exist_ok=True)
        shape = manifest.tensors[name].shape
        _save({"param": reader.tensor(name, torch.float32), "cat_dim": 0}, folder / "fp32.pt")
        for state in states:
            if not reader.covers(f"optim.{state}", name, 0, math.prod(shape)):
                continue
            value = reader.stored_tensor(f"optim.{state}", name, torch.float32)
            _save({"param": value, "cat_dim": 0}, folder / f"{state}.pt")
        if name in steps:
            _save(torch.tensor(steps[name], dtype=torch.float32), folder / "step.pt")
    buffers = {n: reader.tensor(n) for n, t in manifest.tensors.items() if t.kind == "buffer"}
    for name, value in buffers.items():
        (target / "zero" / name).mkdir(exist_ok=True)
        _save({"param": value}, target / "zero" / name / "fp32.pt")
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k in GROUP_SETTINGS}
        for g in manifest.optimizer.groups
    ]
    first_step = next(iter(steps.values()), 0.0)
    _save(
        {
            "param_groups": groups,  # read by DeepSpeed's stage 1-2 optimizers
            "optimizer_state_dict": {  # and by stage 3
                "state": {0: {"step": torch.tensor(first_step, dtype=torch.float32)}},
                "param_groups": groups,
            },
            "zero_stage": manifest.stage,
            "partition_count": manifest.topology.data,
            "ds_version": DEEPSPEED_LAYOUT_VERSION,
        },
        target / "zero" / "optimizer_state.pt",
    )
    model_states = _model_states(reader, trainable, buffers)
    for file in _MODEL_FILES:  # DeepSpeed at stage 3 reads the second name, else the first
        _save(model_states, target / file)
    for pointer in ("latest_universal", "latest"):
        write_text_atomically(root / pointer, out_tag)
    log.info(
        "wrote %s: %d parameters with %s, step %d, as a DeepSpeed universal checkpoint "
        '(load it with "checkpoint": {"load_universal": true})',
        target,
        len(trainable),
        ", ".join(["fp32", *states]),
        manifest.global_steps,
    )
    return target


def _model_states(
    reader: CheckpointReader, trainable: list[str], buffers: dict[str, torch.Tensor]
) -> dict[str, Any]:
    manifest = reader.manifest
    client: dict[str, Any] = {}
    if manifest.client_state is not None:
        loaded = torch.load(reader.path / manifest.client_state, weights_only=True)
        client = loaded if isinstance(loaded, dict) else {"client_state": loaded}
    members = manifest.optimizer.members if manifest.optimizer is not None else None
    groups = [g for g in members or [trainable] if g]
    shapes = [{n: torch.Size(manifest.tensors[n].shape) for n in group} for group in groups]
    return {
        **client,  # DeepSpeed keeps the client state at the top level
        "module": dict(buffers),  # universal loading takes the weights from zero/
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": shapes,  # by param group, as DeepSpeed writes them
        "frozen_param_shapes": {},
        "shared_params": dict(manifest.aliases),
        "frozen_param_fragments": {},
        "lr_scheduler": manifest.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": manifest.skipped_steps,
        "global_steps": manifest.global_steps,
        "global_samples": manifest.global_samples,
        "dp_world_size": manifest.topology.data,
        "mp_world_size": 1,
        "ds_version": DEEPSPEED_LAYOUT_VERSION,
    }

"""The model's weights as one ``state_dict`` in their training dtype (DeepSpeed's
``_zero3_consolidated_16bit_state_dict`` and ``save_16bit_model``): what the transformers
Trainer and DeepSpeed-Chat write as ``pytorch_model.bin`` at the end of training.

Unlike a checkpoint (sharded, with optimizer states, resumable at any world size), this is
the plain ``nn.Module`` state: whole tensors on the CPU, on rank 0 only, tied parameters
stored once under each of their names (one tensor object, so ``torch.save`` keeps the tie).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.comm.agreement import failed_ranks
from zerotrain.utils.logging import get_logger
from zerotrain.zero.gathered import GatheredParameters

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)


def consolidated_state_dict(
    engine: Engine, exclude_frozen_parameters: bool = False
) -> OrderedDict[str, torch.Tensor] | None:
    """Whole parameters and persistent buffers on the CPU on rank 0 (None on the others).
    Collective at stage 3: every rank gathers one module's own parameters at a time, so
    no rank holds more than the largest module's whole parameters on its device."""
    _refuse_split_models(engine, "_zero3_consolidated_16bit_state_dict")
    leader = engine.comm.rank == 0
    state: OrderedDict[str, torch.Tensor] | None = OrderedDict() if leader else None
    copies: dict[int, torch.Tensor] = {}  # id(parameter) -> its CPU copy: ties stay tied

    def visit(module: nn.Module, prefix: str) -> None:
        own = list(module.parameters(recurse=False))
        with GatheredParameters(own):
            if state is not None:
                for name, param in module.named_parameters(recurse=False):
                    if exclude_frozen_parameters and not param.requires_grad:
                        continue
                    if id(param) not in copies:
                        copies[id(param)] = param.detach().to("cpu", copy=True)
                    state[prefix + name] = copies[id(param)]
                for name, buffer in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        state[prefix + name] = buffer.detach().to("cpu", copy=True)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.")

    visit(engine.module, "")
    return state


def save_16bit_model(
    engine: Engine,
    save_dir: str | os.PathLike[str],
    save_filename: str,
    exclude_frozen_parameters: bool,
    gather_on_save: bool,
) -> bool:
    """Write :func:`consolidated_state_dict` to ``save_dir/save_filename`` from rank 0
    (``torch.save``; a ``.safetensors`` name writes safetensors, each tied tensor once).
    Returns False without writing at stage 3 unless ``gather_on_save``
    (``stage3_gather_16bit_weights_on_model_save``), as DeepSpeed does. Every rank raises if
    rank 0 could not write."""
    path = Path(save_dir) / save_filename
    if engine.policy.stage == 3 and not gather_on_save:
        log.info(
            "did not save %s: zero_optimization.stage3_gather_16bit_weights_on_model_save is "
            "false (the weights are partitioned; set it, or use save_checkpoint)",
            path,
        )
        return False
    state = consolidated_state_dict(engine, exclude_frozen_parameters)
    error: Exception | None = None
    if state is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".safetensors":
                _save_safetensors(state, path)
            else:
                torch.save(state, path)
            log.info("saved the model's %d tensors to %s", len(state), path)
        except Exception as exc:
            error = exc
    if failed_ranks(engine.comm, error is not None):
        detail = f": {error}" if error is not None else ""
        raise RuntimeError(f"rank 0 could not write {path}{detail}") from error
    return True


def _save_safetensors(state: OrderedDict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    # safetensors stores no shared tensors: each tied tensor once, under its first name
    # (transformers re-ties the others when it loads the model).
    once: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            once[name] = tensor.contiguous()
    save_file(once, str(path), metadata={"format": "pt"})


def _refuse_split_models(engine: Engine, what: str) -> None:
    topology = engine.topology
    if topology.pipe > 1 or topology.tensor > 1:
        raise NotImplementedError(
            f"{what} with pipeline or tensor parallelism: each rank holds part of the "
            "model; write a checkpoint (save_checkpoint) and consolidate it with "
            "'zerotrain consolidate', which joins the parts"
        )

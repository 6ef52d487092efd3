"""Lightning's checkpoint dictionary as the engine's ``client_state``.

The engine saves the weights, master weights and optimizer states itself, sharded and
addressed by global coordinates (so they load at any world size); everything else Lightning
puts in a checkpoint (loops, callbacks, schedules, epoch and step) rides along as
``client_state``, which must load with ``torch.load(weights_only=True)``: plain containers of
tensors, numbers and strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

# What the engine itself saves and restores.
ENGINE_KEYS = frozenset({"state_dict", "optimizer_states"})
# Informational on resume (only load_from_checkpoint reads them): left out when they hold
# objects that weights_only loading refuses, rather than failing the save.
_OPTIONAL_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
_SCALARS = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device)


def _plain(value: Any) -> Any:
    """``value`` with every mapping a dict (Lightning's ``AttributeDict`` is a subclass that
    weights_only loading refuses)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _loadable(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_loadable(k) and _loadable(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_loadable(v) for v in value)
    return isinstance(value, _SCALARS)


def client_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What of Lightning's ``checkpoint`` the engine stores beside its own states."""
    state = {k: _plain(v) for k, v in checkpoint.items() if k not in ENGINE_KEYS}
    for key in _OPTIONAL_KEYS:
        if key in state and not _loadable(state[key]):
            log.warning(
                "checkpoint: %s holds objects other than tensors, numbers, strings and "
                "containers of them; they are not saved (resuming does not need them)",
                key,
            )
            del state[key]
    return state

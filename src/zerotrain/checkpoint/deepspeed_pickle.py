"""Unpickling DeepSpeed's checkpoint files safely, without DeepSpeed installed.

DeepSpeed writes its checkpoints with ``torch.save`` (pickle). Besides tensors, containers
and numbers, its files hold exactly three classes of its own: the ZeRO stage as
``ZeroStageEnum``, the fp16/bf16 loss scaler (``LossScaler`` or ``DynamicLossScaler``, saved
whole) and, since 0.9, each rank's ``fragment_address`` map of parameter slices. They are read
here with ``torch.load(weights_only=True)`` (no code runs from the file) and an allow-list that
maps exactly those names to the stand-ins below; anything else is refused naming its type.
"""

from __future__ import annotations

import enum
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class SavedLossScaler:
    """A pickled DeepSpeed loss scaler: its attributes (``cur_scale``, ``dynamic``, and for
    dynamic scaling ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``, ...)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def attributes(self) -> dict[str, Any]:
        """The attributes as saved."""
        return dict(vars(self))


@dataclass
class FragmentAddress:
    """DeepSpeed's ``fragment_address``: where a parameter's slice sits in a rank's partition."""

    numel: int
    start: int


class SavedDynamicLossScaler(SavedLossScaler):
    """A pickled ``DynamicLossScaler``."""


ALLOWED: tuple[tuple[type, str], ...] = (
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (SavedDynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_deepspeed_file(path: Path) -> Any:
    """The object pickled in DeepSpeed checkpoint file ``path``.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CorruptCheckpointError: it is not a readable ``torch.save`` file, or it holds a type
            outside the allow-list (named in the message).
    """
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} is missing from the DeepSpeed checkpoint")
    try:
        with torch.serialization.safe_globals(list(ALLOWED)):
            # Mapped, not read: a loading rank touches only the pages of the elements it
            # keeps (files of torch's zip format, which DeepSpeed has written since torch 1.6).
            mmap = zipfile.is_zipfile(path)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        found = _UNSUPPORTED.search(str(exc))
        if found:
            allowed = ", ".join(name for _, name in ALLOWED)
            raise CorruptCheckpointError(
                f"{path} holds an object of type {found.group(1)}, which zerotrain does not "
                f"unpickle: it loads DeepSpeed checkpoints with weights_only=True, allowing "
                f"tensors, containers, numbers and exactly DeepSpeed's own {allowed}. Load the "
                "file in a trusted environment and re-save that entry as plain data"
            ) from exc
        raise CorruptCheckpointError(f"{path}: not a readable DeepSpeed file ({exc})") from exc

"""DeepSpeed's ``ds_*`` attributes on stage-3 parameters, for scripts that read them.

DeepSpeed-Chat, transformers and PEFT find partitioned parameters with
``hasattr(p, "ds_id")`` and gather those whose ``p.ds_status`` is
``ZeroParamStatus.NOT_AVAILABLE``; their export code also reads ``ds_shape`` and
``ds_numel`` (a released parameter is an empty tensor). zerotrain's own code never reads
these attributes: the side tables (``zero/homes.py``) and ``ShardState`` stay the truth, and
``PartitionedParams`` writes the attributes from its state at every transition, so they are
always current. This is the one deliberate exception to "no attributes on parameters", made
because these four names are what that code tests for.

The attributes are plain values (an int, a ``torch.Size``, an enum), so a parameter still
pickles; ``pickle`` keeps them, ``copy.deepcopy`` (``nn.Parameter.__deepcopy__``) drops them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import torch
from torch import nn

_NAMES = ("ds_id", "ds_status", "ds_shape", "ds_numel")


class ZeroParamStatus(enum.Enum):
    """Whether a stage-3 parameter's full value is present (DeepSpeed's names and values)."""

    AVAILABLE = 1  # gathered: the parameter holds its full value
    NOT_AVAILABLE = 2  # released: the parameter is an empty tensor; only a shard exists
    INFLIGHT = 3  # an all-gather is filling it


def describe(params: Sequence[nn.Parameter], shapes: Sequence[tuple[int, ...]]) -> None:
    """Give each parameter its full shape and element count (``ds_shape``, ``ds_numel``)."""
    for param, shape in zip(params, shapes, strict=True):
        param.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
        param.ds_numel = math.prod(shape)  # type: ignore[attr-defined]


def number(params: Sequence[nn.Parameter], first: int) -> None:
    """Give the parameters the ids ``first, first + 1, ...`` (``ds_id``)."""
    for i, param in enumerate(params):
        param.ds_id = first + i  # type: ignore[attr-defined]


def set_status(params: Sequence[nn.Parameter], status: ZeroParamStatus) -> None:
    """Record ``status`` on every parameter (``ds_status``)."""
    for param in params:
        param.ds_status = status  # type: ignore[attr-defined]


def forget(params: Sequence[nn.Parameter]) -> None:
    """Remove the attributes: the parameters are ordinary again (the engine let go)."""
    for param in params:
        for name in _NAMES:
            param.__dict__.pop(name, None)

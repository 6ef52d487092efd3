"""Finding the tensors inside a module's inputs or outputs.

Models return tensors inside tuples, lists, dicts, dataclasses and mapping-like objects
(Hugging Face's ``ModelOutput``). One walker serves every place that must see them (stage-3
hooks on a module's outputs, the FLOPs profiler), so they agree on what counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value`` (tensors, sequences, mappings, dataclasses), depth
    first, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict) or hasattr(value, "items"):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))

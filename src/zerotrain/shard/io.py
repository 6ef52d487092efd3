"""What a unit needs communicated, described rather than issued.

``shard/`` knows *what* moves (which buffer, which slice, what to do when it arrived);
``zero/`` decides *when* and issues it through a communicator (``zero/issue.py``), the way
FSDP2's parameters describe their all-gather inputs and its group runs the collective. So
nothing in ``shard/`` calls a collective, and a unit can be driven over any process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Op = Literal["all_gather", "reduce_scatter", "all_reduce"]


@dataclass(frozen=True, slots=True)
class CollectiveIO:
    """One collective over the unit's ranks.

    Attributes:
        op: ``all_gather`` (every rank's ``input`` chunk into ``output``),
            ``reduce_scatter`` (sum of ``input`` over ranks, this rank's chunk into
            ``output``) or ``all_reduce`` (sum of ``input``, in place: ``output`` is it).
        output: where the result lands.
        input: what this rank contributes.
        purpose: the counter it is recorded under (``parameters``, ``gradients``).
        label: names the unit in messages.
        on_done: run once the result is in ``output``.
        keep_version: refilling ``output`` must stay invisible to autograd (a stage-3
            buffer whose views were saved for backward holds the same values again).
    """

    op: Op
    output: torch.Tensor
    input: torch.Tensor
    purpose: str
    label: str | None
    on_done: Callable[[], None] | None = None
    keep_version: bool = False

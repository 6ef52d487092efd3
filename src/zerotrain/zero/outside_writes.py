"""Parameter values written outside the optimizer (a clamp after each step, a
``load_state_dict`` after ``initialize``): taken into what each unit steps, and reported.

Before every step only the units whose parameters were written (their version counters
moved, or a parameter got new storage) compare their parameters with their masters; on
events (``engine.parameters_changed()``, a checkpoint about to be written) every unit
does. The counts of changed elements stay device tensors until the report (reading them
syncs a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


class OutsideWrites:
    """Adopts and reports outside writes for ``units`` (the strategy's)."""

    def __init__(self, units: Sequence[ShardedUnit]) -> None:
        self.units = list(units)
        self._changed: dict[int, torch.Tensor] = {}  # elements changed, per unit index
        self._told: set[int] = set()

    def adopt(self, only_if_written: bool = False) -> None:
        """Take values changed outside the optimizer into each unit's master:
        ``only_if_written``, the units whose parameters were written (no device work for
        the others); else every unit, element by element."""
        for unit in self.units:
            changed = unit.adopt_outside_changes(only_if_written)
            if changed is not None:
                self._changed[unit.index] = changed + self._changed.get(unit.index, 0)

    def report(self) -> None:
        """Log (once per unit) the units whose parameters were changed outside the
        optimizer since the last report; the optimizer continued from the new values."""
        counts, self._changed = self._changed, {}
        for u, count in counts.items():
            if u not in self._told and int(count) > 0:
                self._told.add(u)
                log.info(
                    "%d parameter elements of %s were changed outside the optimizer; the "
                    "optimizer continued from the new values (said once per unit)",
                    int(count),
                    self.units[u].label,
                )

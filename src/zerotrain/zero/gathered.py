"""``zerotrain.zero.GatheredParameters``: whole stage-3 parameters inside a ``with`` block.

Entering gathers every unit that holds one of the parameters (a collective: every rank must
enter the block with the same parameters) and keeps them gathered through any forward pass
inside the block (so one rank may run the model alone there, e.g. to generate a sample);
leaving frees them again. With
``modifier_rank=r``, what rank r changed inside the block is broadcast and every rank keeps
its slice of the new values. Parameters that are not partitioned (stages 0-2) are left as
they are, except that with ``modifier_rank`` rank r's values are broadcast over the ranks
of their engine, so the ranks stay identical; parameters of no engine are left alone, as
DeepSpeed does (with a warning when a modifier rank is given). ``modifier_rank`` is a rank
of the parameters' ZeRO (data-parallel) group, the global rank when the job has no other
parallel axis. Engines find their parameters through a side table (``zero/homes.py``),
never through attributes on them. Under mixed precision the changed values reach the fp32
master copy: stage-3 units take them before they are released again, other
parameters at the next step (``ShardedUnit.adopt_outside_changes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.comm.collectives import Communicator
from zerotrain.utils.logging import get_logger
from zerotrain.zero.homes import home_of

if TYPE_CHECKING:
    from zerotrain.zero.gather import ParamGatherer

log = get_logger(__name__)

_BUCKET_NUMEL = 50_000_000


def _as_list(params: nn.Parameter | Iterable[nn.Parameter] | None) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    return list(params)


class GatheredParameters:
    """Context manager giving full values of ``params`` inside the block.

    Args:
        params: a parameter or an iterable of them (e.g. ``module.parameters()``).
        modifier_rank: the rank whose in-block changes are kept (None: changes are dropped
            for partitioned parameters; every rank should treat them as read-only).
        fwd_module: accepted for DeepSpeed compatibility; not needed.
        enabled: False makes the block a no-op.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter] | None,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._units: list[tuple[ParamGatherer, int, bool]] = []
        # Whole parameters of engines at stages 0-2, by the communicator of their ranks.
        self._plain: dict[int, tuple[Communicator, list[nn.Parameter]]] = {}
        self._homeless = 0  # parameters of no engine

    def __enter__(self) -> None:
        seen: dict[tuple[int, int], tuple[ParamGatherer, int]] = {}
        for param in self.params:
            home = home_of(param)
            if home is None:
                self._homeless += 1
            elif home.gatherer is None:
                self._plain.setdefault(id(home.comm), (home.comm, []))[1].append(param)
            else:
                seen.setdefault((id(home.gatherer), home.unit), (home.gatherer, home.unit))
        # The same order on every rank, whatever order the parameters came in.
        for _, (gatherer, u) in sorted(seen.items(), key=lambda kv: kv[0][1]):
            was_gathered = gatherer.is_gathered(u)
            gatherer.pin(u)  # a forward inside the block must not free them
            self._units.append((gatherer, u, was_gathered))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._keep_changes(self.modifier_rank)
        finally:
            for gatherer, u, was_gathered in self._units:
                gatherer.unpin(u)
                if not was_gathered:
                    gatherer.free(u)
            self._units.clear()
            self._plain.clear()
            self._homeless = 0
        return None

    def _keep_changes(self, rank: int) -> None:
        for gatherer, u, _ in self._units:
            gatherer.broadcast_changes(u, rank)
        with torch.no_grad():
            for comm, params in self._plain.values():
                tensors = [p.data for p in params]
                broadcast_tensors(comm, tensors, _BUCKET_NUMEL, src=rank)
                for param in params:
                    # Written through .data, which version counters do not see: moving
                    # them is how the engine's next step knows to take the new values.
                    torch.autograd.graph.increment_version(param)
        if self._homeless:
            log.warning(
                "GatheredParameters(modifier_rank=%d): %d parameter(s) belong to no zerotrain "
                "engine, so no communicator is known for them; their changes stay on the "
                "ranks that made them (DeepSpeed also leaves them alone)",
                rank,
                self._homeless,
            )

"""Parameters that got no gradient in an accumulation window, on any rank: found with one
all-reduce of flags at the end of the window's boundary backward, and left out of the
optimizer step as plain PyTorch leaves out a parameter whose ``.grad`` is None.

At stage 3 the gather fingerprint of the window rides on the same all-reduce, so ranks that
ran different forward or backward passes fail with an error naming the unit.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger
from zerotrain.zero.gather import ParamGatherer

log = get_logger(__name__)


class DivergedRanksError(RuntimeError):
    """Ranks gathered different stage-3 units in one step (they took different code paths)."""


class UsedParameters:
    """Which of the units' parameters got a gradient in the current window, over ``comm``.

    Args:
        units: the strategy's units.
        comm: the ranks whose gradients are summed (ZeRO's group).
        num_params: the model's parameter count (ids ``0 .. num_params - 1``; parameters
            outside the units, frozen ones, always count as used).
        gatherer: stage 3's gatherer, whose fingerprint is compared across ranks; None at
            stages 0-2.
    """

    def __init__(
        self,
        units: Sequence[ShardedUnit],
        comm: Communicator,
        num_params: int,
        gatherer: ParamGatherer | None,
    ) -> None:
        self.units = list(units)
        self.comm = comm
        self.num_params = num_params
        self.gatherer = gatherer
        self._used: tuple[torch.Tensor, Handle] | None = None
        # Whether every trainable parameter got a gradient on this rank in the window.
        self._used_everything = False
        self._told_stepped = False
        # The last window's fingerprints, when their comparison was left on the device.
        self.deferred_prints: torch.Tensor | None = None
        self._trainable_ids = torch.tensor(
            [
                pid
                for unit in self.units
                for pid, trains in zip(unit.param_ids, unit.trainable, strict=True)
                if trains
            ],
            dtype=torch.long,
            device=comm.device,
        )

    def discard(self) -> None:
        """Forget the window's exchange (another backward reopens the window; it exchanges
        again at its end)."""
        if self._used is not None:
            self._used[1].wait()
            self._used = None

    def exchange(self) -> None:
        """Start an all-reduce of which parameters got a gradient in this window (at the
        end of its boundary backward: it runs behind the gradient reductions)."""
        # 1 = used; parameters outside the units (frozen) count as used, so that the common
        # case (everything used) is recognised with one check. At stage 3 the gather
        # fingerprint rides along, as (v, -v): one max-reduction yields its max and min.
        flags = torch.ones(self.num_params, dtype=torch.float64, device=self.comm.device)
        # The common case, every trainable parameter got a gradient here, needs no index
        # tensor (built from a Python list, a host-to-device copy on an accelerator).
        self._used_everything = all(
            len(unit.received) == unit.trainable_count for unit in self.units
        )
        if not self._used_everything:
            flags[self._trainable_ids] = 0.0
            ids = [unit.param_ids[i] for unit in self.units for i in unit.received]
            if ids:
                flags[torch.tensor(ids, device=flags.device)] = 1.0
        if self.gatherer is not None:
            prints = torch.tensor(self.gatherer.fingerprint(), dtype=torch.float64)
            self.gatherer.reset_fingerprint()
            flags = torch.cat([flags, prints.to(flags.device), -prints.to(flags.device)])
        self._used = flags, self.comm.all_reduce(flags, purpose="control", op="max", async_op=True)

    def share(self, units: Sequence[int], comm: Communicator) -> None:
        """After the boundary backward: the parameters of ``units`` count as used if they
        got a gradient on any rank of ``comm`` (the stages holding copies of a tied module,
        whose gradients are summed into each copy; ``units`` laid out alike on all)."""
        invariant(self._used is not None, "share() before a boundary backward pass")
        flags, handle = self._used  # type: ignore[misc]
        handle.wait()
        ids = torch.tensor(
            [pid for u in units for pid in self.units[u].param_ids], device=flags.device
        )
        if ids.numel():
            mine = flags[ids]
            comm.all_reduce(mine, purpose="control", op="max")
            flags[ids] = mine

    def check_same_gathers(self, tail: torch.Tensor) -> None:
        """Raise on every rank if the ranks gathered different units in the window whose
        exchanged fingerprints (the tail of its flags) are ``tail``."""
        n = tail.numel() // 2
        high, low = tail[:n].tolist(), [-v for v in tail[n:].tolist()]
        if high == low:
            return
        differing = [
            f"'{unit.label}' gathered between {int(low[u])} and {int(high[u])} times"
            for u, unit in enumerate(self.units)
            if high[u] != low[u]
        ]
        what = (
            "; ".join(differing)
            if differing
            else "every unit was gathered equally often, but in a different order"
        )
        raise DivergedRanksError(
            f"rank {self.comm.rank}: the ranks ran different forward/backward passes in this "
            f"step (stage 3 gathers each unit collectively, so every rank must run the same "
            f"modules the same number of times): {what} per rank"
        )

    def unused(self, found_inf: torch.Tensor | None = None) -> list[tuple[ShardedUnit, int]]:
        """Parameters that got no gradient on any rank in this window.

        ``found_inf``: the step's inf/NaN flag, kept on the device (engine/verdict.py); the
        stage-3 fingerprint comparison then stays there too: ranks that gathered
        differently set the flag, so the step is skipped, and ``deferred_prints`` keeps the
        fingerprints for ``check_same_gathers`` once the skip is read."""
        invariant(self._used is not None, "optimizer step without a boundary backward pass")
        flags, handle = self._used  # type: ignore[misc]
        self._used = None
        handle.wait()
        self.deferred_prints = None
        if self.gatherer is not None:
            tail = flags[self.num_params :]
            if found_inf is None:
                self.check_same_gathers(tail)
            else:
                n = tail.numel() // 2
                diverged = (tail[:n] + tail[n:]).ne(0).any()  # max != min somewhere
                torch.maximum(found_inf, diverged.to(found_inf.dtype), out=found_inf)
                self.deferred_prints = tail
            flags = flags[: self.num_params]
        if self._used_everything:
            # Every parameter got a gradient here, so the maximum over the ranks (and over
            # share()'s groups) is all ones: nothing to read back (a host sync on an
            # accelerator).
            return []
        if bool(flags.all()):
            return []
        used = set(flags.nonzero().view(-1).tolist())
        return [
            (unit, i)
            for unit in self.units
            for i, pid in enumerate(unit.param_ids)
            if pid not in used
        ]

    @contextlib.contextmanager
    def untouched(
        self, unused: list[tuple[ShardedUnit, int]], optimizer: torch.optim.Optimizer
    ) -> Iterator[None]:
        """Undo an optimizer step for ``unused`` parameters, as plain PyTorch skips a
        parameter whose gradient is None: no momentum, no weight decay.

        A piece holding only unused parameters gets its whole state back; where used and
        unused parameters share a piece, their values and moments are restored but the
        piece's shared step count still advances (Adam's bias correction for those few
        parameters then differs slightly from per-parameter counting).
        """
        unused_ids = {unit.param_ids[index] for unit, index in unused}
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        whole: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for unit in {id(u): u for u, _ in unused}.values():
            for piece in unit.pieces:
                if all(pid in unused_ids for _, _, pid in piece.segments):
                    # Nothing in the piece was used: its whole state (step counts included,
                    # so bias corrections match plain PyTorch) is put back.
                    state = optimizer.state.get(piece.param, {})
                    whole.append((piece.param, copy.deepcopy(dict(state))))
                    saved.append((piece.param, piece.param.clone()))
        whole_ids = {id(p) for p, _ in whole}
        shared: list[tuple[torch.Tensor, slice, set[str]]] = []
        for unit, index in unused:
            for piece, where in unit.owned_slices(index):
                if id(piece.param) in whole_ids:
                    continue
                state = optimizer.state.get(piece.param, {})
                tensors = [piece.param] + [
                    t
                    for t in state.values()
                    if isinstance(t, torch.Tensor) and t.shape == piece.param.shape
                ]
                saved += [(t[where], t[where].clone()) for t in tensors]
                shared.append((piece.param, where, set(state)))
        yield
        for target, value in saved:
            target.copy_(value)
        for param, where, existed in shared:
            # State the step created (momentum, moments on the first step) starts at zero
            # for a parameter that had no gradient, as if it had not been stepped.
            for key, value in optimizer.state.get(param, {}).items():
                new = key not in existed and isinstance(value, torch.Tensor)
                if new and value.shape == param.shape:
                    value[where].zero_()
        for param, state in whole:
            if state:
                optimizer.state[param] = state
            else:
                optimizer.state.pop(param, None)

    @contextlib.contextmanager
    def stepped_anyway(self, unused: list[tuple[ShardedUnit, int]], why: str) -> Iterator[None]:
        """Optimizers that cannot leave a parameter out of a step (``why``: NVMe offload
        streams the states through it; the 1-bit optimizers average every momentum) step
        parameters without a gradient with a zero one (said once)."""
        if unused and not self._told_stepped:
            self._told_stepped = True
            names = ", ".join(unit.buffer.layout.params[i].fqn for unit, i in unused[:5])
            log.warning(
                "%d parameter(s) got no gradient in this step (%s%s); %s, so they are stepped "
                "with a zero gradient (moments decay, weight decay applies), unlike plain "
                "PyTorch, which skips them (said once)",
                len(unused),
                names,
                ", ..." if len(unused) > 5 else "",
                why,
            )
        yield

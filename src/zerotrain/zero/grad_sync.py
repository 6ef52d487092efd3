"""When gradients are reduced: from autograd hooks, as soon as each unit is complete.

On an accumulation-boundary backward pass, every parameter's post-accumulate-grad hook marks
it ready; a unit's reduction is launched (asynchronously) once all of its parameters are ready
*and* every earlier unit has been launched. Launching strictly in unit order keeps the
sequence of collectives identical on every rank even if ranks finish units in different
orders (for example, a parameter unused on one rank), so it can never mismatch collectives.
On other micro-steps the hooks only keep ``param.grad`` bound to the flat buffer: no
communication at all.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch.utils.hooks import RemovableHandle

from zerotrain.comm.collectives import Handle
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.invariant import invariant


class GradientSynchronizer:
    """Drives the reduction of every unit's gradient during backward.

    Args:
        units: in reduction order (as ``build_units`` returns them).
        overlap: launch reductions from the hooks (True) or only after backward (False).
    """

    def __init__(self, units: Sequence[ShardedUnit], overlap: bool) -> None:
        self.units = list(units)
        self.overlap = overlap
        self._remaining = [0] * len(self.units)
        self._ready: list[set[int]] = [set() for _ in self.units]
        self._next = 0
        self._handles: list[Handle] = []
        self._syncing = False
        self._hooks: list[RemovableHandle] = []
        for u, unit in enumerate(self.units):
            for i, param in enumerate(unit.buffer.params):
                hook = functools.partial(self._on_grad, u, i)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def begin_backward(self, sync: bool) -> None:
        """Arm the hooks for one backward pass; ``sync`` on accumulation boundaries."""
        invariant(not self._handles, "previous backward's reductions were never finished")
        self._syncing = sync
        self._next = 0
        for u, unit in enumerate(self.units):
            self._remaining[u] = len(unit.buffer.params)
            self._ready[u].clear()

    def _on_grad(self, u: int, i: int, _param: object) -> None:
        unit = self.units[u]
        unit.buffer.adopt_grad(i)
        if not self._syncing:
            return
        if u < self._next:
            name = unit.buffer.layout.params[i].fqn
            raise RuntimeError(
                f"gradient of '{name}' arrived after its bucket was already reduced in this "
                "backward pass; call engine.backward() once per micro-step (sum several losses "
                "first) and do not run a second backward on the boundary step"
            )
        if i not in self._ready[u]:
            self._ready[u].add(i)
            self._remaining[u] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.units) and self._remaining[self._next] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        self._handles.append(self.units[self._next].launch_reduce(async_op=True))
        self._next += 1

    def end_backward(self) -> None:
        """After autograd finished: launch what is left (unused parameters contribute zeros)
        and wait for every reduction. No-op on non-boundary micro-steps."""
        if not self._syncing:
            return
        while self._next < len(self.units):
            self._launch_next()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()
        self._syncing = False

    @property
    def launched_count(self) -> int:
        """Units whose reduction was launched in the current backward pass."""
        return self._next

    def remove(self) -> None:
        """Detach every hook (the model is left with plain parameters and gradients)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

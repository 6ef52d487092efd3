"""When gradients are reduced: as soon as each unit is complete, in unit order.

On a backward pass that communicates (the accumulation boundary; every micro-step at stages
2-3, which keep no full-size gradient between micro-steps), a unit's reduction is launched
asynchronously once it is ready *and* every earlier unit has been launched. Launching strictly
in unit order keeps the sequence of collectives identical on every rank even if ranks finish
units in different orders (a parameter unused on one rank), so collectives never mismatch.

What "ready" means differs by stage:

* Stages 0-2 (units are buckets of parameters, not modules): every parameter's
  post-accumulate-grad hook marks it ready; the unit is ready when all are.
* Stage 3 (units are modules): one signal per unit, ``mark_done``, when the module's
  backward is over for every outstanding forward pass (``ParamGatherer``). Autograd runs a
  parameter's gradient accumulation as soon as it can (its nodes come first in the ready
  queue), so by then every gradient of that backward is in ``param.grad``; the unit takes
  them all in one pass (``_collect``), with no Python hook per parameter. A gradient that
  still arrives after its unit was reduced is found at the end of backward and raised.

On the other micro-steps gradients are only kept where the unit expects them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.shard.grads import ShardedGradients
from zerotrain.shard.staging import StagingBatch, StagingPool, StagingSource
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.invariant import InvariantError, invariant
from zerotrain.utils.logging import get_logger
from zerotrain.zero.issue import (
    batch_small_units,
    is_small_unit,
    issue,
    issue_reduce_scatters,
)

log = get_logger(__name__)


def _on_grad(sync: weakref.ref[GradientSynchronizer], u: int, i: int, param: torch.Tensor) -> None:
    target = sync()
    if target is not None:
        target._on_grad(u, i, param)


def _acquire_staging(sync: weakref.ref[GradientSynchronizer], u: int) -> torch.Tensor:
    target = sync()
    if target is None:
        raise InvariantError("staging asked of a dropped gradient synchronizer")
    return target._acquire_staging(target.units[u].pool)


def _before_grad(sync: weakref.ref[GradientSynchronizer], grad: torch.Tensor) -> None:
    target = sync()
    if target is not None:
        target._before_grad(grad)


class GradientSynchronizer:
    """Drives the reduction of every unit's gradient during backward.

    Args:
        units: in reduction order (as ``build_units`` returns them).
        comm: the ranks the units' gradients are reduced over.
        overlap: let reductions run while backward continues (True), or wait for each one
            as it is launched (False: no overlap, but at most one unit's gradient staged).
        every_micro_step: reduce on every micro-step, not only at the boundary (stages 2-3).
        launch_when_complete: launch a unit's reduction as soon as its gradients are all in,
            as per-parameter hooks report them (stages 0-2). Stage 3 instead takes a unit's
            gradients and launches on ``mark_done``, when the unit's module finished its
            backward: gathers run in the same stream of collectives, and "all gradients
            arrived" differs between ranks when a parameter is unused on one of them, which
            would interleave reductions and gathers differently per rank.
        on_outside_grad: called before a gradient produced by a backward pass other than
            the engine's own (``begin_backward`` .. ``wait``) is accumulated into a
            parameter; such gradients stay in ``param.grad``, as plain PyTorch keeps them.
        coalesce_numel: reduce consecutive small units (in launch order) in one
            collective of up to this many elements, launched when the last of them is done
            (``launch_when_complete`` False only; 0: every unit alone). Their staging comes
            from ``pools``, one per dtype, sized for the largest batch.
    """

    def __init__(
        self,
        units: Sequence[ShardedUnit],
        comm: Communicator,
        overlap: bool,
        every_micro_step: bool,
        launch_when_complete: bool = True,
        on_outside_grad: Callable[[], None] | None = None,
        coalesce_numel: int = 0,
    ) -> None:
        invariant(not (coalesce_numel and launch_when_complete), "coalescing needs mark_done")
        self.coalesce_numel = coalesce_numel
        self.units = list(units)
        self.comm = comm
        self.overlap = overlap
        self.every_micro_step = every_micro_step
        self.launch_when_complete = launch_when_complete
        self._done = [False] * len(self.units)
        self._remaining = [0] * len(self.units)
        self._ready: list[set[int]] = [set() for _ in self.units]
        self._next = 0  # position in ``_order`` of the next unit to launch
        # Launch order: unit order, but units that only end_backward can report done go last
        # (``launch_last``); the same on every rank.
        self._order = list(range(len(self.units)))
        self._position = list(range(len(self.units)))
        # Batches of positions in ``_order`` launched as one collective (_plan_batches):
        # the end position of the batch starting at each position, the start of each
        # unit's batch, and how many members of the batch starting at each position are
        # not done yet.
        self._batch_end: list[int] = []
        self._batch_start: list[int] = []
        self._missing = [1] * len(self.units)
        # Combined collectives in flight (each holds packing buffers of its batch's size):
        # at most two, the older waited for before a third starts.
        self._combined: list[Handle] = []
        self._replan = False  # the launch order changed while gradients were staged
        self._own_pool = [unit.pool for unit in self.units]
        self.pools: list[StagingPool] = []
        self._batch_pools: dict[int, StagingPool] = {}
        if coalesce_numel:
            self._make_batch_pools()
        self._handles: list[Handle] = []
        self._syncing = False
        self._final = False
        self._in_backward = False  # between begin_backward and wait/abort
        self.on_outside_grad = on_outside_grad
        # Parameters the next backward will not reach (a dropped layer), by unit and index:
        # counted as ready from the start, so the units holding them are reduced while
        # backward runs instead of after it.
        self._where = {
            id(param): (u, i)
            for u, unit in enumerate(self.units)
            for i, param in enumerate(unit.buffer.params)
            if unit.trainable[i]
        }
        self._absent: set[tuple[int, int]] = set()
        self._hooks: list[RemovableHandle] = []
        # The hooks reach this object weakly: autograd holds a leaf's hooks from C++, where
        # the garbage collector cannot see them, so a strong reference would close a cycle
        # (parameter -> hook -> units -> parameter) that keeps a dropped engine's model,
        # shards and communicators alive until the process ends.
        me = weakref.ref(self)
        # Each unit's staging provider, made once (a hook allocates nothing per call); weak
        # like the hooks, so that it closes no cycle either.
        self._staging = [functools.partial(_acquire_staging, me, u) for u in range(len(units))]
        self._plan_batches()
        # Stage 3: each unit's trainable parameters, for _collect.
        self._trained = [
            [(i, p) for i, p in enumerate(unit.buffer.params) if unit.trainable[i]]
            for unit in self.units
        ]
        before_grad = functools.partial(_before_grad, me)
        for u, unit in enumerate(self.units):
            for i, param in enumerate(unit.buffer.params):
                if unit.trainable[i]:
                    if launch_when_complete:
                        on_grad = functools.partial(_on_grad, me, u, i)
                        self._hooks.append(param.register_post_accumulate_grad_hook(on_grad))
                    self._hooks.append(param.register_hook(before_grad))

    def launch_last(self, units: set[int]) -> None:
        """Launch ``units`` after every other unit: nothing reports them done before the end
        of backward (stage 3: a unit called with no input that needs a gradient has no
        module backward to signal it), so in their place in unit order they held back
        every unit behind them. Every rank must give the same set."""
        order = [u for u in range(len(self.units)) if u not in units] + sorted(units)
        if order == self._order:
            return
        invariant(not self._in_backward, "launch order changed during backward")
        self._order = order
        for position, u in enumerate(order):
            self._position[u] = position
        self._plan_batches()

    def _make_batch_pools(self) -> None:
        """One pool per staging pool that small units use, its buffers as large as the
        largest batch can be: every small unit of it, up to ``coalesce_numel``."""
        small: dict[int, tuple[StagingPool, int]] = {}
        for pool, unit in zip(self._own_pool, self.units, strict=True):
            numel = unit.buffer.layout.padded_numel
            if isinstance(pool, StagingPool) and is_small_unit(numel, self.coalesce_numel):
                total = small.get(id(pool), (pool, 0))[1]
                small[id(pool)] = (pool, total + numel)
        for key, (pool, total) in small.items():
            batch_pool = StagingPool(min(total, self.coalesce_numel), pool.dtype, pool.device)
            self._batch_pools[key] = batch_pool
            self.pools.append(batch_pool)

    def _plan_batches(self) -> None:
        """Group runs of small units of one dtype in launch order into batches (each up
        to ``coalesce_numel`` elements) and point their staging at the batch's buffer; every
        other unit is a batch of one with its own pool. The same on every rank."""
        n = len(self.units)
        self._replan = self._anything_staged()
        if self._replan:
            # Units holding staged gradients (a window without synchronisation) keep their
            # staging until it is reduced: every unit goes alone until then, and the batches
            # are planned again at the first backward with nothing staged.
            self._batch_end = [p + 1 for p in range(n)]
            self._batch_start = list(self._position)  # each unit starts its own batch
            return
        for pool in self.pools:
            pool.forget_views()  # the batches they were made for are replaced

        def kind(u: int) -> int | None:
            pool = self._own_pool[u]
            return id(pool) if id(pool) in self._batch_pools else None

        order = self._order
        sizes = [self.units[u].buffer.layout.padded_numel for u in order]
        runs = batch_small_units(sizes, [kind(u) for u in order], self.coalesce_numel)
        self._batch_end = [p + 1 for p in range(n)]
        self._batch_start = list(range(n))
        for run in runs:
            members = [order[p] for p in run]
            for p in run:
                self._batch_start[order[p]] = run.start
            self._batch_end[run.start] = run.stop
            if len(run) == 1:
                own = self._own_pool[members[0]]
                if own is not None and self.units[members[0]].pool is not own:
                    self.units[members[0]].stage_through(own)
                continue
            pool = self._batch_pools[id(self._own_pool[members[0]])]
            batch = StagingBatch(pool, [self.units[u].buffer.layout.padded_numel for u in members])
            for u, member in zip(members, batch.members, strict=True):
                self.units[u].stage_through(member)

    def _anything_staged(self) -> bool:
        return any(
            isinstance(unit.grads, ShardedGradients) and unit.grads.staged for unit in self.units
        )

    def begin_backward(self, boundary: bool, requires_sync: bool = True) -> None:
        """Arm the hooks for one backward pass (``boundary``: last micro-step of a window;
        ``requires_sync`` False: keep this pass's gradients on this rank, unreduced, for a
        later pass to reduce together with its own, as DDP's ``no_sync``)."""
        invariant(not self._handles, "previous backward's reductions were never finished")
        if self._replan and not self._anything_staged():
            self._plan_batches()
        self._final = boundary and requires_sync
        self._syncing = requires_sync and (boundary or self.every_micro_step)
        self._in_backward = True
        self._next = 0
        for u, unit in enumerate(self.units):
            self._remaining[u] = sum(unit.trainable)
            self._ready[u].clear()
            self._done[u] = False
        for u, i in self._absent:
            self._ready[u].add(i)
            self._remaining[u] -= 1
        for u in {u for u, _ in self._absent}:
            # A unit none of whose parameters backward reaches has no module backward to
            # report it done (stage 3): it is done now.
            self._done[u] = self._remaining[u] == 0
        self._absent = set()
        for start in range(len(self.units)):
            if self._batch_start[self._order[start]] == start:
                members = self._order[start : self._batch_end[start]]
                self._missing[start] = sum(not self._done[u] for u in members)

    def expect_no_gradient(self, params: Sequence[torch.Tensor]) -> None:
        """The next backward pass will produce no gradient for ``params`` on any rank (their
        module was skipped, the same way everywhere): their units need not wait for them.
        A gradient that arrives anyway is still taken if its unit is not reduced yet, and
        is an error if it is (as for any late gradient)."""
        self._absent = {self._where[id(p)] for p in params if id(p) in self._where}

    def takes_in_place(self, param: torch.Tensor) -> bool:
        """A layer may add ``param``'s gradient into ``param.grad`` itself now: the engine's
        own backward pass, which reduces nothing, with ``param.grad`` its unit's buffer view
        (zero/fused_wgrad.py; it then runs the post-accumulate hook as autograd would)."""
        where = self._where.get(id(param))
        if where is None or not self._in_backward or self._syncing:
            return False
        u, i = where
        return self.units[u].grad_is_buffer_view(i, param.grad)

    def _before_grad(self, _grad: torch.Tensor) -> None:
        if not self._in_backward and self.on_outside_grad is not None:
            self.on_outside_grad()

    def _on_grad(self, u: int, i: int, _param: torch.Tensor) -> None:
        if not self._in_backward:
            return  # another engine's (or a plain) backward: the gradient stays in .grad
        unit = self.units[u]
        if self._syncing and self._position[u] < self._next:
            name = unit.buffer.layout.params[i].fqn
            raise RuntimeError(
                f"gradient of '{name}' arrived after its bucket was already reduced in this "
                "backward pass; call engine.backward() once per micro-step (sum several losses "
                "first) and do not run a second backward on the same micro-step"
            )
        unit.accept_grad(i, self._staging[u])
        if i in self._ready[u]:
            return
        self._ready[u].add(i)
        self._remaining[u] -= 1
        if self._remaining[u] == 0:
            unit.gradients_complete()
        if not self._syncing:
            return
        while self._next < len(self.units) and self._remaining[self._order[self._next]] == 0:
            self._launch_next()

    def _collect(self, u: int) -> None:
        """Stage 3: take whatever gradients of unit ``u`` autograd left in ``param.grad``
        (into staging, together, freeing them)."""
        if not self._in_backward:
            return
        if self._syncing and self._position[u] < self._next:
            return  # reduced already: what arrived since stays for _check_nothing_late
        unit, staging = self.units[u], self._staging[u]
        took = False
        for i, param in self._trained[u]:
            if param.grad is not None:
                unit.accept_grad(i, staging)
                took = True
        if took:
            unit.gradients_complete()

    def _check_nothing_late(self) -> None:
        """Stage 3, end of a backward pass that reduced every unit: a gradient still in
        ``param.grad`` arrived after its unit's reduction was launched."""
        for u, trained in enumerate(self._trained):
            for i, param in trained:
                if param.grad is not None:
                    param.grad = None  # not part of any window (the step is abandoned)
                    name = self.units[u].buffer.layout.params[i].fqn
                    raise RuntimeError(
                        f"gradient of '{name}' arrived after its unit was already reduced in "
                        "this backward pass (a use of the parameter outside its module's "
                        "forward, or a second backward on the same micro-step); call "
                        "engine.backward() once per micro-step (sum several losses first)"
                    )

    def mark_done(self, u: int) -> None:
        """Stage 3: unit ``u``'s module finished its backward: take its gradients and
        launch, in unit order, what is done."""
        self._collect(u)
        if not self._syncing or self._done[u]:
            return
        self._done[u] = True
        self._missing[self._batch_start[u]] -= 1
        while self._next < len(self.units) and self._missing[self._next] == 0:
            self._launch_next()

    def _acquire_staging(self, pool: StagingSource | None) -> torch.Tensor:
        if pool is None:
            raise InvariantError("a unit without a staging pool asked for staging")
        while True:
            buffer = pool.acquire()
            if buffer is not None:
                return buffer
            pending = [h for h in self._handles if not h.finished]
            if not pending:
                # Every buffer is held by a unit still filling: waiting would never end.
                # Without gradient sync every unit keeps its staged gradient until a later
                # pass reduces it: growing is expected then.
                report = log.warning if self._syncing else log.debug
                report("gradient staging pool grown to %d buffers", pool.count + 1)
                return pool.grow()
            pending[0].wait()  # its completion returns a buffer to the pool

    def _launch_next(self) -> None:
        start, end = self._next, self._batch_end[self._next]
        if not self.launch_when_complete:
            for u in self._order[start:end]:
                self._collect(u)  # also what arrived since its mark_done
        ios = [
            self.units[u].launch_reduce(final=self._final, staging=self._staging[u])
            for u in self._order[start:end]
        ]
        if len(ios) == 1 or self.comm.world_size == 1:  # alone, nothing moves: no packing
            handles = [issue(self.comm, io) for io in ios]
        else:
            self._combined = [h for h in self._combined if not h.finished]
            if len(self._combined) >= 2:
                self._combined.pop(0).wait()
            handles = [issue_reduce_scatters(self.comm, ios)]
            self._combined.append(handles[0])
        self._next = end
        if self.overlap:
            self._handles.extend(handles)
        else:
            for handle in handles:
                handle.wait()

    def launch_remaining(self) -> None:
        """After autograd finished: launch what is left (parameters without a gradient
        contribute zeros)."""
        if self._syncing:
            while self._next < len(self.units):
                self._launch_next()
            if not self.launch_when_complete:
                self._check_nothing_late()
        elif not self.launch_when_complete:
            for u in range(len(self.units)):
                self._collect(u)

    def wait(self) -> None:
        """Wait for every reduction of this backward pass."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()
        self._combined = []
        self._syncing = False
        self._in_backward = False

    def end_backward(self) -> None:
        """``launch_remaining`` then ``wait``."""
        self.launch_remaining()
        self.wait()

    def abort(self) -> None:
        """Recover from an exception raised during backward: finish the reductions already
        launched (every rank launched the same ones if they all failed alike), then reset
        every unit, discarding the gradients of the current accumulation window."""
        handles, self._handles = self._handles, []
        self._combined = []
        try:
            for handle in handles:
                handle.wait()
        finally:
            self._syncing = False
            self._in_backward = False
            for unit in self.units:
                unit.reset()

    def remove(self) -> None:
        """Detach every hook (the model is left with plain parameters and gradients)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

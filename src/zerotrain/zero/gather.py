"""Stage 3: gathering each unit's parameters around its use and releasing them after.

Forward: a unit is gathered in its module's pre-forward hook and freed by its post-forward
hook; the units that ran next in the previous forward pass are prefetched (up to
``prefetch_numel`` elements, never beyond ``max_live_numel`` gathered at once). Backward: the
post-forward hook registers a hook on the module's outputs that fires as soon as the first
gradient reaches them, before any of the module's own backward runs; it gathers the unit
again and prefetches the unit that ran before it. The unit is freed once the module's
backward is over for the call (an identity node on the call's inputs runs its backward;
for a call recomputed by reentrant checkpointing, on the recomputed call's inputs), and at
the latest at the end of backward; that signal is also when the unit's gradients are taken
and reduced (``GradientSynchronizer.mark_done``). Units below the persistence threshold are
gathered once and kept.

Backward bookkeeping is kept per forward pass (one micro-batch), so the forwards of several
micro-batches may be outstanding before their backwards (a pipeline's 1F1B order): a unit
is freed as soon as one pass's backward is done with it (a later use gathers it again), and
its reduction is launched once every outstanding pass is done with it. A backward retires
the passes it reached; passes no backward reached are dropped at the optimizer step.
With ``reshard_after_backward`` off, units gathered for backward stay gathered (no gather
for the next micro-batch) until a backward with it on ends, or the optimizer step.

Every gather is counted per unit and folded into a fingerprint of the sequence; the strategy
compares fingerprints across ranks at each accumulation boundary, so ranks that gathered
different units (one skipped a block) fail with an error naming the unit instead of
exchanging the wrong parameters.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.config.policies import Stage3Policy
from zerotrain.shard.partitioned import PartitionedParams
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.invariant import invariant
from zerotrain.utils.torch_compat import in_backward, tree_flatten, tree_unflatten
from zerotrain.utils.tree import tensors_in
from zerotrain.zero.homes import Home, register, unregister
from zerotrain.zero.issue import issue

_HASH_MODULUS = 1 << 50  # exact in float64, so fingerprints survive an all-reduce
# Arguments a module call may pass without a tree flatten (anything else may hold tensors
# that a flatten finds: containers, pytree-registered classes).
_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


class _PostBackward(torch.autograd.Function):
    """Identity on a module call's inputs; its backward (after every node of the module's
    backward for that call, having been created before all of them) reports the call done."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.done()
        return (None, *grads)


@dataclasses.dataclass
class _GradInputs:
    """A module call's arguments, flattened, and where the tensors that need a gradient are."""

    flat: list[Any]
    spec: Any  # the tree flatten's spec; None: ``flat`` is the positional arguments
    kwargs: dict[str, Any]
    where: list[int]

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _GradInputs | None:
        """The call's inputs (None: no tensor among them needs a gradient)."""
        # The common call (tensors and scalars, no keywords) is its own flat list: a tree
        # flatten and unflatten cost more than the rest of a module hook.
        simple = not kwargs and all(isinstance(a, _LEAVES) for a in args)
        flat, spec = (list(args), None) if simple else tree_flatten((args, kwargs))
        where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        return _GradInputs(flat, spec, kwargs, where) if where else None

    def routed(self, done: Callable[[], None]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with those tensors passed through one ``_PostBackward``
        node, whose backward calls ``done``."""
        marked = _PostBackward.apply(done, *[self.flat[i] for i in self.where])
        for i, tensor in zip(self.where, marked, strict=True):
            self.flat[i] = tensor
        if self.spec is None:
            return tuple(self.flat), self.kwargs
        new_args, new_kwargs = tree_unflatten(self.flat, self.spec)
        return new_args, new_kwargs


@dataclasses.dataclass(eq=False)  # passes are told apart by identity
class ForwardPass:
    """The backward bookkeeping of one forward pass (a micro-batch): per unit, the calls
    whose inputs carry a post-backward signal, and the signals received so far."""

    calls: list[int]
    signals: list[int]
    reached: bool = False  # a signal arrived: the backward that retires it has begun


# transformers reads the first attribute (``is_fsdp_managed_module``) to keep every rank's
# forward passes in step where their number could differ: ``generate()`` then defaults to
# ``synced_gpus=True`` with several ranks, and layer-drop models run every layer. A stage-3
# forward gathers with collectives, so it needs exactly that (DeepSpeed's signal,
# ``is_deepspeed_zero3_enabled()``, exists only with DeepSpeed installed). torch.compile
# reads both: it then treats the module as one whose parameters change between calls,
# which they do here. Set on every module of the model, removed with the hooks.
SHARDED_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run as plain Python even inside a compiled region: a module compiled with
    ``module.compile()`` calls its hooks from the compiled code, and torch.compile must not
    trace the gathers and frees (collectives, storage resizes, ``.data`` swaps)."""
    return torch.compiler.disable(hook)


class ParamGatherer:
    """Drives gathering and freeing of stage-3 units from module hooks.

    Args:
        units: every stage-3 unit (indices as in the strategy).
        modules: the module each unit wraps (same order as ``units``).
        root: the model; its forward delimits one forward pass.
        comm: collectives over the data-parallel group.
        policy: prefetch, persistence and live-memory bounds.
    """

    def __init__(
        self,
        units: Sequence[ShardedUnit],
        modules: Sequence[nn.Module],
        root: nn.Module,
        comm: Communicator,
        policy: Stage3Policy,
    ) -> None:
        self.units = list(units)
        self.comm = comm
        self.policy = policy
        self._storage = [self._partitioned(u) for u in self.units]
        self._pending: dict[int, Handle] = {}
        self._trace: list[int] = []  # units in the order the previous forward pass used them
        # Made from the trace once per pass, for the prefetch of every module call: each
        # unit's position in it, and the units that are not persistent (the only ones a
        # prefetch gathers) with their positions.
        self._trace_position: dict[int, int] = {}
        self._fetchable: list[int] = []
        self._fetchable_at: list[int] = []
        self._modules = list(modules)
        # Units the next forward pass will not run (progressive layer drop told us): never
        # prefetched from the previous pass's order.
        self._skipped: set[int] = set()
        self._current: list[int] = []
        self._current_set: set[int] = set()
        self._in_forward = 0
        self.counts = [0] * len(self.units)
        self.sequence_hash = 0
        # Backward bookkeeping: the forward passes whose backward has not run, the pass the
        # current forward records into, and the callback told when a unit's backward is
        # over for every outstanding pass (on every rank at the same point of the same
        # graph, unlike "every gradient arrived", which a parameter unused on one rank
        # changes).
        # Held weakly: a pass lives as long as its graph (whose post-backward nodes hold
        # it), so forwards that no backward will reach (a metric computed with gradients
        # on, never backpropagated) cannot pile up between optimizer steps.
        self._passes: weakref.WeakSet[ForwardPass] = weakref.WeakSet()
        self._recording: ForwardPass | None = None
        self.on_backward_done: Callable[[int], None] | None = None
        # Units called with no input that needs a gradient: no module backward signals
        # them, so only the end of backward reports them done (launched last).
        self.unsignalled: set[int] = set()
        self.reshard_after_backward = True
        # Set by a pipeline, whose every backward starts from one micro-batch's outputs:
        # the passes outstanding when a backward begins that it does not reach add no
        # gradient in it, so a unit's reduction waits only for the passes it reaches (and
        # those it creates: recomputation under activation checkpointing).
        self.one_pass_per_backward = False
        self._not_this_backward: weakref.WeakSet[ForwardPass] = weakref.WeakSet()
        self._held: set[int] = set()  # gathered for backward, kept (reshard_after_backward off)
        self._user_pins = 0  # GatheredParameters blocks open
        self.live_bytes = 0
        self.peak_bytes = 0
        # NVMe parameter offload: shards of this many units beyond the prefetched ones are
        # read back from their swap files ahead of need (0: no offload).
        self.read_ahead = 0
        # Why gathers are refused now (engine.offload_states moved the shards away).
        self.refusal: str | None = None
        self._hooks: list[RemovableHandle] = []
        # Made once: every module call with gradients registers one on its outputs.
        self._pre_backward_hooks = [
            functools.partial(self._pre_backward, u) for u in range(len(self.units))
        ]
        # Calls recomputed inside the current backward whose own backward has not run yet.
        self._recomputed = [0] * len(self.units)
        self._recomputed_done_hooks = [
            functools.partial(self._recomputed_done, u) for u in range(len(self.units))
        ]
        root_unit = next((u for u, m in enumerate(modules) if m is root), None)
        for u, module in enumerate(modules):
            if module is root:
                continue
            pre = _eager(functools.partial(self._pre, u))
            self._hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            post = _eager(functools.partial(self._post, u))
            self._hooks.append(module.register_forward_hook(post, always_call=True))
        root_pre = _eager(functools.partial(self._root_pre, root_unit))
        self._hooks.append(root.register_forward_pre_hook(root_pre, with_kwargs=True))
        root_post = _eager(functools.partial(self._root_post, root_unit))
        self._hooks.append(root.register_forward_hook(root_post, always_call=True))
        self._marked = [m for m in root.modules() if not hasattr(m, SHARDED_MARKS[0])]
        for module in self._marked:
            for mark in SHARDED_MARKS:
                setattr(module, mark, True)
        first_id = 0
        for u, storage in enumerate(self._storage):
            register(list(storage.params), Home.of_unit(comm, self, u))  # for GatheredParameters
            storage.number(first_id)  # DeepSpeed's ds_id, read by export scripts
            first_id += len(storage.params)
        for u, unit in enumerate(self.units):
            if unit.numel < policy.persistence_threshold:
                self._issue(u, count=False).wait()
                self._pending.pop(u)
                self._storage[u].make_persistent()

    @staticmethod
    def _partitioned(unit: ShardedUnit) -> PartitionedParams:
        invariant(isinstance(unit.buffer, PartitionedParams), "stage-3 unit without partitions")
        return unit.buffer  # type: ignore[return-value]

    # -- gather / free --------------------------------------------------------------------------

    def _issue(self, u: int, count: bool = True) -> Handle:
        if self.refusal is not None:
            raise RuntimeError(self.refusal)
        storage = self._storage[u]
        handle = issue(self.comm, storage.unshard(self.units[u].label))
        self._pending[u] = handle
        self.live_bytes += storage.full_nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if count:
            self.counts[u] += 1
            self.sequence_hash = (self.sequence_hash * 1_000_003 + u + 1) % _HASH_MODULUS
        return handle

    def fetch(self, u: int) -> None:
        """Make unit ``u``'s parameters whole (gather unless already gathered)."""
        if not self._storage[u].gathered:
            self._issue(u)
        handle = self._pending.pop(u, None)
        if handle is not None:
            handle.wait()

    def is_gathered(self, u: int) -> bool:
        """Whether unit ``u``'s parameters are whole right now."""
        return self._storage[u].gathered

    def broadcast_changes(self, u: int, src: int) -> None:
        """Make rank ``src``'s values of gathered unit ``u`` everyone's, slices included."""
        self.fetch(u)
        storage = self._storage[u]
        full = storage.full
        with torch.no_grad():
            for i, param in enumerate(storage.params):
                view = storage.view(full, i)
                if param.data.data_ptr() != view.data_ptr():  # replaced, not changed in place
                    view.copy_(param.data)
                    param.data = view
        self.comm.broadcast(full, src=src, purpose="parameters")
        storage.scatter_back()
        self.units[u].adopt_outside_changes()  # before the unit is released again

    def pin(self, u: int) -> None:
        """Gather unit ``u`` and keep it gathered until ``unpin`` (hooks do not free it)."""
        self.fetch(u)
        self._storage[u].pin()
        self._user_pins += 1

    def unpin(self, u: int) -> None:
        """End one ``pin`` of unit ``u`` (it stays gathered until something frees it)."""
        self._storage[u].unpin()
        self._user_pins -= 1

    def free(self, u: int) -> None:
        """Release unit ``u``'s gathered parameters (persistent, pinned and held units
        stay)."""
        storage = self._storage[u]
        handle = self._pending.pop(u, None)
        if handle is not None:
            handle.wait()  # never drop a buffer a collective still writes into
        if not storage.freeable:
            return  # sharded already, pinned, held or persistent
        storage.free()
        self.live_bytes -= storage.full_nbytes

    def release_held(self) -> None:
        """Release the units kept gathered by backward passes without resharding."""
        held, self._held = self._held, set()
        for u in held:
            self._storage[u].unpin()
            self.free(u)

    def free_all(self) -> None:
        """Release every non-persistent unit (end of backward, or after an error)."""
        for u in range(len(self.units)):
            self.free(u)
            self._storage[u].drop_shard()  # read ahead for a use that did not come

    def _prefetch(self, candidates: Iterator[int]) -> None:
        """Gather the units that come next until ``prefetch_numel`` elements ahead are
        gathered (those already gathered count), within ``max_live_numel`` in all."""
        budget = self.policy.prefetch_numel
        for v in candidates:
            storage = self._storage[v]
            numel = storage.layout.padded_numel  # (persistent units are not candidates)
            if budget < numel:
                storage.prefetch_shard()
                break
            budget -= numel
            if storage.gathered:
                continue
            live_numel = self.live_bytes // storage.shard.element_size()
            if live_numel + numel > self.policy.max_live_numel:
                storage.prefetch_shard()
                break
            self._issue(v)
        for _, v in zip(range(self.read_ahead - 1), candidates, strict=False):
            self._storage[v].prefetch_shard()

    def _set_trace(self, trace: list[int]) -> None:
        self._trace = trace
        self._trace_position = {u: i for i, u in enumerate(trace)}
        fetchable = [(i, u) for i, u in enumerate(trace) if not self.units[u].persistent]
        self._fetchable_at = [i for i, _ in fetchable]
        self._fetchable = [u for _, u in fetchable]

    def _after_in_trace(self, u: int, step: int) -> Iterator[int]:
        """The units a prefetch may gather after ``u`` in the previous pass's order
        (``step`` > 0: forward; < 0: backward, the units before it, nearest first)."""
        i = self._trace_position.get(u)
        if i is None:
            return iter(())
        if step > 0:
            order: Iterator[int] = itertools.islice(
                self._fetchable, bisect.bisect_right(self._fetchable_at, i), None
            )
        else:
            before = bisect.bisect_left(self._fetchable_at, i)
            order = (self._fetchable[k] for k in range(before - 1, -1, -1))
        skipped = self._skipped
        return (v for v in order if v not in skipped) if skipped else order

    def skip_in_next_pass(self, modules: Sequence[nn.Module]) -> None:
        """The next forward pass will not call ``modules`` (a dropped layer): their units
        are not prefetched for it. Cleared when that pass ends."""
        inside = {id(m) for module in modules for m in module.modules()}
        self._skipped = {u for u, m in enumerate(self._modules) if id(m) in inside}

    # -- hooks ----------------------------------------------------------------------------------

    def _pre(
        self, u: int, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.fetch(u)
        if in_backward():
            # A forward recomputed inside backward (activation checkpointing): backward
            # prefetches the units before this one; the ones after it are done already.
            if not torch.is_grad_enabled():
                return None
            return self._free_after_recomputed_backward(u, args, kwargs)
        if u not in self._current_set:
            self._current_set.add(u)
            self._current.append(u)
        self._prefetch(self._after_in_trace(u, +1))
        if not torch.is_grad_enabled():
            return None
        return self._signal_after_backward(u, args, kwargs)

    def _signal_after_backward(
        self, u: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Route the call's inputs through a node whose backward runs once the gradients
        with respect to them are computed: the module's backward for this call is over."""
        inputs = _GradInputs.of(args, kwargs)
        if inputs is None:
            self.unsignalled.add(u)  # no signal from this call: done at the end of backward
            return None
        record = self._recording
        if record is None:  # a unit called outside the model's forward: a pass of its own
            record = self._new_pass()
        record.calls[u] += 1
        return inputs.routed(functools.partial(self._post_backward, record, u))

    def _free_after_recomputed_backward(
        self, u: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A call recomputed inside backward (reentrant activation checkpointing, whose
        first forward ran without gradients and so set no signal): route its tensor inputs
        through a node whose backward frees the unit once every recomputed call of it is
        done, instead of keeping it gathered until the end of backward. (Non-reentrant
        checkpointing discards the recomputed graph; its calls' own signals free the unit.)"""
        inputs = _GradInputs.of(args, kwargs)
        if inputs is None:
            return None
        self._recomputed[u] += 1
        return inputs.routed(self._recomputed_done_hooks[u])

    def _recomputed_done(self, u: int) -> None:
        self._recomputed[u] -= 1
        if self._recomputed[u] == 0:
            self.free(u)

    def _new_pass(self) -> ForwardPass:
        record = ForwardPass([0] * len(self.units), [0] * len(self.units))
        self._passes.add(record)
        return record

    def begin_backward(self) -> None:
        """A backward pass begins: with ``one_pass_per_backward``, note the passes
        outstanding now (those it does not reach keep no reduction waiting)."""
        if self.one_pass_per_backward:
            self._not_this_backward = weakref.WeakSet(self._passes)

    def _post_backward(self, record: ForwardPass, u: int) -> None:
        if record not in self._passes:
            return  # a pass retired already (a graph kept with retain_graph, run again)
        record.reached = True
        record.signals[u] += 1
        if record.signals[u] != record.calls[u]:
            return
        # This pass is done with the unit: free it (another outstanding pass gathers it
        # again if it needs it). Its reduction waits until every outstanding pass is done
        # (a later pass of the same backward may still add gradients to it), or with
        # ``one_pass_per_backward`` every pass this backward reached or created.
        self.free(u)
        if self.on_backward_done is None or u in self.unsignalled:
            return  # a call of it without a signal may still add gradients
        waiting = [
            p
            for p in self._passes
            if not self.one_pass_per_backward or p.reached or p not in self._not_this_backward
        ]
        if all(p.signals[u] == p.calls[u] for p in waiting):
            self.on_backward_done(u)

    def end_backward(self) -> None:
        """The backward pass is over: retire the forward passes it reached (the others
        stay outstanding for a later backward) and release what it gathered, unless
        ``reshard_after_backward`` is off."""
        for record in [p for p in self._passes if p.reached]:
            self._passes.discard(record)
        self._recomputed = [0] * len(self.units)
        if self.reshard_after_backward:
            self.release_held()
            self.free_all()

    def abort_backward(self) -> None:
        """After autograd raised: forget every outstanding pass and release everything."""
        self._passes.clear()
        self._recomputed = [0] * len(self.units)
        self.release_held()
        self.free_all()

    def end_window(self) -> None:
        """The optimizer step: forward passes no backward reached are dropped (their
        graphs cannot feed this window's gradients any more), and held units released
        (the step changes the shards they were gathered from)."""
        self._passes.clear()
        self.release_held()

    @property
    def outstanding_passes(self) -> int:
        """Forward passes whose backward has not run yet."""
        return len(self._passes)

    def _post(self, u: int, _module: nn.Module, _args: Any, output: Any) -> None:
        if in_backward():
            # A forward recomputed inside backward (activation checkpointing): its backward
            # follows at once, so the unit stays gathered until that is done (the signal
            # set by _free_after_recomputed_backward), or the end of backward.
            return
        if torch.is_grad_enabled():
            if isinstance(output, torch.Tensor) and output.grad_fn is not None:
                # One output: its node's pre-hook fires as that node, the first of the
                # module's backward, is about to run (the multi-tensor hook below does the
                # same for several outputs at ~20x the cost per call).
                output.grad_fn.register_prehook(self._pre_backward_hooks[u])
            else:
                wanted = [t for t in tensors_in(output) if t.requires_grad]
                if wanted:
                    torch.autograd.graph.register_multi_grad_hook(
                        wanted, self._pre_backward_hooks[u], mode="any"
                    )
        self.free(u)

    def _root_pre(
        self, u: int | None, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._in_forward += 1
        if self._in_forward == 1:
            self._current = []
            self._current_set = set()
            self._recording = (
                self._new_pass() if torch.is_grad_enabled() and not in_backward() else None
            )
        return self._pre(u, module, args, kwargs) if u is not None else None

    def _root_post(self, u: int | None, module: nn.Module, args: Any, output: Any) -> None:
        self._in_forward -= 1
        if u is not None:
            self._post(u, module, args, output)
        if self._in_forward == 0:
            recorded, self._recording = self._recording, None
            if recorded is not None and not any(recorded.calls):
                self._passes.discard(recorded)  # nothing to signal: no backward reaches it
            if not self._user_pins:  # a pass inside GatheredParameters may run on one rank
                self._set_trace(self._current)
            self._skipped = set()
            self.free_all()  # prefetched units the pass did not use after all

    def _pre_backward(self, u: int, _grad: Any) -> None:
        self.fetch(u)
        if not self.reshard_after_backward and u not in self._held:
            self._held.add(u)
            self._storage[u].pin()  # kept until a resharding backward ends, or the step
        self._prefetch(self._after_in_trace(u, -1))

    # -- fingerprint ----------------------------------------------------------------------------

    def fingerprint(self) -> list[float]:
        """Gathers per unit and a hash of their order since the last reset."""
        return [float(c) for c in self.counts] + [float(self.sequence_hash)]

    def reset_fingerprint(self) -> None:
        """Start counting a new accumulation window."""
        self.counts = [0] * len(self.units)
        self.sequence_hash = 0

    def remove(self) -> None:
        """Detach every hook."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._marked:
            for mark in SHARDED_MARKS:
                module.__dict__.pop(mark, None)
        self._marked = []
        for storage in self._storage:
            unregister(list(storage.params))

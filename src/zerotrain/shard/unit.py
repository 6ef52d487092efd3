"""A unit: parameters reduced, stepped and gathered together, over one flat buffer.

The same class serves every ZeRO stage; the ``ZeroPolicy`` decides what is partitioned:
stage 0 keeps everything whole, stage 1 steps only this rank's slice (gradients
reduce-scattered into it), stage 2 additionally keeps only that slice of the gradient, and
stage 3 also keeps only that slice of the parameters (``PartitionedParams``: gathered around
each use by ``zero/gather.py``). After an optimizer step, stages 1-2 all-gather the updated
slices so every rank again holds the whole parameters; stage 3 keeps them sharded.

Under mixed precision the parameters are held in the compute dtype (bf16/fp16) and the unit
keeps an fp32 master copy of the range this rank steps: the optimizer updates the master,
which is then rounded into the parameters (``publish``). Gradients accumulate and reduce in
the dtypes the ``PrecisionPolicy`` names.

The unit owns the mechanics (which collective, which slice), and returns each collective it
needs as a description (``shard/io.py``); *when* its methods run, and issuing what they
describe, is ``zero/``'s (``grad_sync.py``, ``strategy.py``, ``issue.py``). Gradient states
move through a checked cycle, so an ordering bug raises at once instead of stepping
half-reduced gradients.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from zerotrain.config.policies import GradReducePolicy, PrecisionPolicy
from zerotrain.shard.flat_buffer import FlatParamBuffer
from zerotrain.shard.grads import FullGradients, ShardedGradients, StagingProvider
from zerotrain.shard.io import CollectiveIO
from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.owned import ValueSource, copy_owned_range
from zerotrain.shard.partitioned import PartitionedParams, ShardState
from zerotrain.shard.policy import ZeroPolicy
from zerotrain.shard.staging import StagingPool, StagingSource
from zerotrain.shard.storage import (
    ResidentPlacement,
    SlotStorage,
    StatePlacement,
    held_in_memory,
)
from zerotrain.utils.invariant import InvariantError, invariant


class Ranks(Protocol):
    """Where a unit's ranks are: this rank, how many share the unit, and their device (a
    communicator has these; the unit never calls it)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...


class GradState(enum.Enum):
    """Where a unit's gradient is in the step."""

    ACCUMULATING = "accumulating"  # autograd adds micro-step gradients in
    REDUCING = "reducing"  # a reduction is in flight
    REDUCED = "reduced"  # averaged over ranks for the whole window; ready for the optimizer


@dataclass(frozen=True)
class OptimizerPiece:
    """The part of one optimizer group's parameters in a unit that this rank updates.

    ``param`` is a view of the unit's parameter buffer, or of its fp32 master copy;
    ``segments`` lists ``(start, end, param_id)`` of every parameter fragment inside. Its
    ``.grad`` is bound by ``ShardedUnit.bind_optimizer_grads``.
    """

    group: int
    param: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    start: int  # offset of ``param`` in the unit's flat buffer


class ShardedUnit:
    """One flat buffer of parameters, its gradient, and how both are communicated.

    Args:
        index: position of the unit in reduction order (identical on every rank).
        layout: packing of the parameters (``world_size`` > 1 when states are partitioned).
        params: the parameters, in ``layout`` order.
        groups: optimizer group of each parameter (None: averaged but never updated).
        param_ids: a model-wide id of each parameter (for per-parameter norms and masks).
        ranks: this rank and the number of ranks sharing the unit (its ZeRO group).
        zero: what is partitioned.
        reduce: how gradients are averaged.
        staging: the staging pool (stages 2-3).
        trainable: whether each parameter receives gradients (stage 3 units also hold frozen
            parameters, which are partitioned and gathered like the rest); default: all.
        label: names the unit in messages (stage 3: the module it wraps).
        values: the full value of each parameter when they are not materialised (stage 3).
        precision: dtypes of parameters, gradients and their reduction; master weights.
        master_on_host: optimizer offload: on an accelerator, keep the fp32 copy the
            optimizer steps in host memory (also for fp32 parameters).
        placement: where the master, gradient slice and parameter shard keep their values
            (``shard/storage.py``; default: in memory). NVMe offload passes its ``Offload``,
            which moves them to swap files as the unit is built.
    """

    def __init__(
        self,
        index: int,
        layout: FlatLayout,
        params: Sequence[nn.Parameter],
        groups: Sequence[int | None],
        param_ids: Sequence[int],
        ranks: Ranks,
        zero: ZeroPolicy,
        reduce: GradReducePolicy,
        staging: StagingPool | None = None,
        trainable: Sequence[bool] | None = None,
        label: str | None = None,
        values: ValueSource | None = None,
        precision: PrecisionPolicy | None = None,
        master_on_host: bool = False,
        placement: StatePlacement | None = None,
    ) -> None:
        sharded = zero.shard_optimizer
        invariant(
            layout.world_size == (ranks.world_size if sharded else 1),
            "layout world size does not match the policy",
        )
        self.index = index
        self.zero = zero
        self.reduce_policy = reduce
        self.label = label or f"unit {index}"
        precision = precision or PrecisionPolicy()
        self.model_dtypes = tuple(p.dtype for p in params)
        if precision.compute is None and len(set(self.model_dtypes)) > 1:
            raise ValueError(
                f"the parameters of '{self.label}' mix dtypes "
                f"{sorted(map(str, set(self.model_dtypes)))}; cast the model to one dtype (or "
                "enable bf16/fp16, which casts it)"
            )
        compute, accum, comm_dtype = precision.resolve(params[0].dtype)
        self.owned = layout.shard_range(ranks.rank) if sharded else (0, layout.padded_numel)

        def value_of(i: int) -> torch.Tensor:
            return values(i) if values is not None else params[i].detach()

        # The master copy comes from the parameters' own values (fp32 as built), not from
        # their rounding to the compute dtype. It covers what the optimizer steps: the
        # owned part of the grouped parameters, which come first in the layout (frozen and
        # ungrouped ones last, stage 3 partitions them too).
        lo, hi = self.owned
        stepped_end = next(
            (spec.start for spec, g in zip(layout.params, groups, strict=True) if g is None),
            layout.padded_numel,
        )
        self.master_range = (lo, max(lo, min(hi, stepped_end)))
        mlo, mhi = self.master_range
        device = ranks.device if zero.shard_parameters else params[0].device
        self.device = device
        # Offload on an accelerator: the optimizer steps an fp32 copy in host memory, even
        # when the parameters themselves are fp32.
        host_master = master_on_host and device.type != "cpu"
        self.master: torch.Tensor | None = None
        self.buffer: FlatParamBuffer | PartitionedParams
        if host_master:
            self.master = copy_owned_range(
                layout, self.master_range, value_of, torch.float32, torch.device("cpu")
            )
        if zero.shard_parameters:
            wide = torch.float32 if precision.master_weights else compute
            owned = copy_owned_range(layout, self.owned, value_of, wide, device)
            if precision.master_weights and not host_master:
                self.master = owned if mhi == hi else owned[: mhi - mlo].clone()
            self.buffer = PartitionedParams(layout, params, ranks.rank, owned.to(compute))
        else:
            if precision.master_weights and not host_master:
                self.master = copy_owned_range(
                    layout, self.master_range, value_of, torch.float32, device
                )
            self.buffer = FlatParamBuffer(layout, params, compute)
        # Where the master's values live (None: no master); see _place.
        self.master_slot: SlotStorage | None = None
        self.groups = tuple(groups)
        self.param_ids = tuple(param_ids)
        self.trainable = tuple(trainable) if trainable is not None else (True,) * len(params)
        self.trainable_count = sum(self.trainable)
        self.grads: FullGradients | ShardedGradients
        if zero.shard_gradients:
            invariant(staging is not None, "stage 2 needs a staging pool")
            invariant(staging.dtype == comm_dtype, "staging pool in the wrong dtype")  # type: ignore[union-attr]
            self.grads = ShardedGradients(self.buffer, self.owned, staging, accum)  # type: ignore[arg-type]
        else:
            invariant(isinstance(self.buffer, FlatParamBuffer), "stage 3 keeps no full gradient")
            self.grads = FullGradients(
                self.buffer,  # type: ignore[arg-type]
                self.owned,
                sharded,
                accum,
                comm_dtype,
            )
        # The optimizer's gradient: the reduced slice itself, or its fp32 copy at the step
        # when gradients accumulate in a 16-bit dtype next to fp32 master weights.
        self._step_grad: torch.Tensor | None = None
        self._pieces_bound = False  # the pieces' .grad were bound by a step
        # Pieces on the host whose gradient is on the accelerator (optimizer offload), by
        # id(piece.param): bound each step instead of ``.grad``.
        self.off_device_grads: dict[int, torch.Tensor] = {}
        # The reduced gradient set aside by reopen_window, added back once the window's
        # further passes are reduced.
        self._carried: torch.Tensor | None = None
        self.state = GradState.ACCUMULATING
        self.received: set[int] = set()  # parameters that got a gradient this window
        self.pieces = self._make_pieces()
        self._place(placement or ResidentPlacement())
        # Version counters of the parameters when their values were last taken: an in-place
        # write to a parameter (a clamp under no_grad, load_state_dict) moves its counter.
        self._versions = self._param_versions()

    def _param_versions(self) -> list[int]:
        return [p._version for p in self.buffer.params]

    def written_in_place(self) -> bool:
        """Whether a parameter was written in place since its values were last taken (a
        host-side check of version counters: no device work). Writes through ``p.data``
        leave the counters alone and are not seen."""
        return self._param_versions() != self._versions

    def _place(self, placement: StatePlacement) -> None:
        """Give each state its storage. Last in construction, once every view of the states
        exists (pieces, parameters): storage in a file frees the memory right away, so
        building a model never holds more than one unit's values."""
        if self.master is not None:
            self.master_slot = placement.master(self.master)
            invariant(self.master_slot.tensor is self.master, "the slot must hold the master")
        self.grads.place(placement)
        self.buffer.place(placement, self.numel)

    @property
    def persistent(self) -> bool:
        """Stage 3: the unit stays gathered for the engine's life."""
        return (
            isinstance(self.buffer, PartitionedParams)
            and self.buffer.state is ShardState.PERSISTENT
        )

    def __repr__(self) -> str:
        names = ", ".join(s.fqn for s in self.buffer.layout.params[:3])
        more = "" if len(self.buffer.params) <= 3 else f", +{len(self.buffer.params) - 3}"
        return f"ShardedUnit({self.index} {self.label}: {names}{more}; {self.state.value})"

    # -- layout ---------------------------------------------------------------------------------

    @property
    def numel(self) -> int:
        """Elements of real parameters in this unit (padding excluded)."""
        return self.buffer.layout.numel

    @property
    def grad_slot(self) -> SlotStorage:
        """Where the gradient slice lives (in memory, or a swap file under NVMe offload)."""
        return self.grads.slot

    def grad_squared_norm(self) -> torch.Tensor:
        """Sum of squares of the reduced gradient slice (0-d fp64), without reading a slice
        kept in a file (its sum was taken as it was written out)."""
        return self.grads.slot.squared_norm(lambda: self.grad_shard)

    def first_nonfinite_grad(self) -> str | None:
        """The name of the first parameter whose gradient in this rank's owned range holds
        inf/NaN (None: none, or the slice is in a swap file)."""
        if self.grads.slot.streamed:
            return None
        bad = (~torch.isfinite(self.grad_shard)).nonzero()
        if bad.numel() == 0:
            return None
        offset = self.owned[0] + int(bad[0, 0])
        layout = self.buffer.layout
        return next((p.fqn for p in layout.params if p.start <= offset < p.end), None)

    def grads_to_scale(self) -> list[torch.Tensor]:
        """The gradient to multiply in memory by the unscale/clip factor: none when the
        offloaded step streams the slice (it scales each chunk as it reads it)."""
        return [] if self.grads.slot.streamed else [self.grad_shard]

    @property
    def grad_shard(self) -> torch.Tensor:
        """The reduced gradient of this rank's owned range (padding included), in the dtype
        the optimizer steps: views of it are the pieces' ``.grad``."""
        if self.grads.slot.streamed:  # (the message is built only when raised: hot path)
            raise InvariantError(f"{self!r}: the gradient slice is streamed from a swap file")
        shard = self.grads.shard
        if self.master is None or shard.dtype == torch.float32:
            return shard
        if self._step_grad is None:
            self._step_grad = shard.float()
        return self._step_grad

    @property
    def master_nbytes(self) -> int:
        """Bytes of the fp32 master copy in memory (0 without mixed precision, or while it
        is swapped out to a file)."""
        return 0 if self.master_slot is None else self.master_slot.resident_bytes

    @property
    def param_slot(self) -> SlotStorage:
        """Where this rank's parameter values live between uses (stage 3 with NVMe
        parameter offload: a swap file; otherwise memory)."""
        return self.buffer.slot

    def _state_slots(self) -> tuple[SlotStorage, ...]:
        master = () if self.master_slot is None else (self.master_slot,)
        return (*master, self.buffer.slot)

    def resident(self, write_back: bool) -> contextlib.AbstractContextManager[None]:
        """Keep master and parameter shard in memory for the duration, wherever they live
        (for checkpoints and ``release``); ``write_back``: store them afterwards."""
        return held_in_memory(self._state_slots(), write_back)

    def offloadable_states(self) -> dict[str, list[torch.Tensor]]:
        """The tensors holding this unit's states now, under DeepSpeed's
        ``offload_states`` names: ``lp_params`` (the parameter buffer, or at stage 3 this
        rank's slice and the gathered buffer), ``hp_params`` (the fp32 master) and
        ``lp_grads`` (everything holding gradient values). Views of them (parameters,
        ``.grad``, the optimizer's pieces) share their storage."""
        if isinstance(self.buffer, PartitionedParams):
            lp = [self.buffer.shard, self.buffer.full]
        else:
            lp = [self.buffer.data]
        grads = self.grads.tensors()
        grads += [t for t in (self._step_grad, self._carried) if t is not None]
        return {
            "lp_params": lp,
            "hp_params": [] if self.master is None else [self.master],
            "lp_grads": grads,
        }

    def point_params(self, host: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
        """While ``engine.offload_states`` holds the parameter values in host memory, make
        the parameters views of that copy (``host`` maps the unit's buffer to it), so that
        they read correctly there, as DeepSpeed's offloaded parameters do; ``None``: back
        to the unit's own buffer. Stage-3 parameters not gathered stay empty."""
        buffer = self.buffer
        if isinstance(buffer, PartitionedParams):
            if not buffer.gathered:
                return
            root = buffer.full
        else:
            root = buffer.data
        flat = root if host is None else host(root)
        if flat is None:
            return
        with torch.no_grad():
            for i, param in enumerate(buffer.params):
                param.data = buffer.view(flat, i)

    def bind_optimizer_grads(self) -> None:
        """Point each piece's ``.grad`` at its part of :attr:`grad_shard` (an optimizer's
        ``zero_grad()`` drops these references; without them the piece would be skipped).
        A streamed slice is read by the offloaded step itself."""
        if self.grads.slot.streamed:
            return
        lo = self.owned[0]
        grad = self.grad_shard
        self.off_device_grads.clear()
        for piece in self.pieces:
            start = piece.start - lo
            view = grad[start : start + piece.param.numel()]
            if view.device != piece.param.device:
                # Optimizer offload on an accelerator: the piece is a host master, the
                # gradient stays on the device (torch refuses a .grad on another device);
                # the offloaded step copies it chunk by chunk.
                self.off_device_grads[id(piece.param)] = view
            else:
                piece.param.grad = view
        self._pieces_bound = True

    def _make_pieces(self) -> tuple[OptimizerPiece, ...]:
        lo, hi = self.owned
        specs = self.buffer.layout.params
        pieces = []
        start = 0
        while start < len(specs):  # parameters of one group are contiguous (group-major)
            end = start
            while end < len(specs) and self.groups[end] == self.groups[start]:
                end += 1
            group = self.groups[start]
            a, b = max(lo, specs[start].start), min(hi, specs[end - 1].end)
            if group is not None and a < b:
                segments = tuple(
                    (max(a, s.start) - a, min(b, s.end) - a, self.param_ids[k])
                    for k, s in enumerate(specs[start:end], start=start)
                    if max(a, s.start) < min(b, s.end)
                )
                if self.master is not None:
                    param = self.master[a - lo : b - lo]
                else:
                    param = self.buffer.owned_slice(a, b)
                pieces.append(OptimizerPiece(group, param, segments, a))
            start = end
        return tuple(pieces)

    def owned_slices(self, index: int) -> list[tuple[OptimizerPiece, slice]]:
        """Where the owned part of ``params[index]`` sits inside this unit's pieces."""
        spec = self.buffer.layout.params[index]
        found = []
        for piece in self.pieces:
            a = max(spec.start, piece.start)
            b = min(spec.end, piece.start + piece.param.numel())
            if a < b:
                found.append((piece, slice(a - piece.start, b - piece.start)))
        return found

    # -- backward -------------------------------------------------------------------------------

    def accept_grad(self, index: int, staging: StagingProvider) -> None:
        """Autograd finished ``params[index]``'s gradient for this micro-step."""
        self.grads.accept(index, staging)
        self.received.add(index)

    @property
    def pool(self) -> StagingSource | None:
        """Where this unit's gradients are staged (None: stages 0-1, kept whole)."""
        return self.grads.pool if isinstance(self.grads, ShardedGradients) else None

    def stage_through(self, source: StagingSource) -> None:
        """Stage gradients through ``source`` from now on (its slice of a batch reduced
        in one collective, or its own pool again); nothing may be staged now."""
        invariant(isinstance(self.grads, ShardedGradients), "only sharded gradients stage")
        grads: ShardedGradients = self.grads  # type: ignore[assignment]
        invariant(not grads.staged, f"{self.label}: restaged while gradients are staged")
        grads.pool = source

    def grad_is_buffer_view(self, index: int, grad: torch.Tensor | None) -> bool:
        """``grad`` is ``params[index]``'s view of a full-size gradient buffer (stages 0-1
        with the parameters' dtype): adding into it in place is accumulating."""
        return isinstance(self.grads, FullGradients) and self.grads.holds(index, grad)

    def gradients_complete(self) -> None:
        """Every trainable parameter got its gradient in this backward pass: fold fresh
        gradients into the unit's buffer together (one foreach operation)."""
        self.grads.complete()

    def launch_reduce(self, *, final: bool, staging: StagingProvider) -> CollectiveIO:
        """The reduction of this micro-step's gradient (the caller issues it); ``final`` on
        the window's last one."""
        if self.state is not GradState.ACCUMULATING:
            raise InvariantError(f"{self!r}: reduce launched twice")
        self.state = GradState.REDUCING

        def on_done() -> None:
            self.state = GradState.REDUCED if final else GradState.ACCUMULATING
            if final:
                self._add_carried()

        if isinstance(self.grads, ShardedGradients):
            return self.grads.reduce(self.reduce_policy, on_done, staging, self.label, final=final)
        return self.grads.reduce(self.reduce_policy, on_done, self.label)

    # -- optimizer step -------------------------------------------------------------------------

    def attach_grads(self) -> None:
        """Before the engine's own backward pass (see ``FullGradients.attach``)."""
        self.grads.attach()

    def detach_grads(self) -> None:
        """After the engine's own backward pass, or a step that bound ``param.grad``."""
        self.grads.detach()

    def drop_outside_grads(self) -> None:
        """Clear gradients that backward passes outside the engine left in ``param.grad``
        (the engine's own window lives in its buffers and is kept)."""
        for param in self.buffer.params:
            param.grad = None

    def optimizer_grads_dropped(self) -> bool:
        """Whether the optimizer's ``zero_grad()`` cleared the pieces' ``.grad`` since the
        last step bound them (how an ``optimizer.zero_grad()`` call is seen)."""
        return self._pieces_bound and any(
            p.param.grad is None and id(p.param) not in self.off_device_grads for p in self.pieces
        )

    def forget_optimizer_grads(self) -> None:
        """The dropped piece gradients were acted on; the next step binds them again."""
        self._pieces_bound = False

    def bind_grads(self) -> None:
        """Point every ``param.grad`` at the unit's gradient (stage 0, for a user optimizer
        that steps the model's own parameters)."""
        invariant(isinstance(self.grads, FullGradients), "parameter gradients are not kept")
        self.grads.bind()  # type: ignore[union-attr]

    def keep_local_gradient(self, divide_by: float) -> None:
        """End the window without a reduction: the gradient stays this rank's own, divided
        by ``divide_by`` (what the reduction would have divided by, without the ranks), for
        an optimizer that communicates it itself (the 1-bit optimizers)."""
        invariant(
            isinstance(self.grads, FullGradients),
            f"{self!r}: local gradients need the whole gradient (ZeRO stages 0-1)",
        )
        invariant(self.state is GradState.ACCUMULATING, f"{self!r}: window already reduced")
        if divide_by != 1.0:
            self.grads.flat.div_(divide_by)  # type: ignore[union-attr]
        self.state = GradState.REDUCED
        self._add_carried()

    def reopen_window(self) -> None:
        """Another backward pass on the micro-step whose backward already closed the window
        (several ``engine.backward()`` calls before ``step()``, which DeepSpeed allows).
        The reduced gradient is set aside and the unit accumulates from zero; once the new
        passes are reduced (or kept local) the two are added. Averaging is linear, so that
        is the average of the whole window's gradient, at every stage (reducing the buffer
        again in place would not be: at stage 1 the other ranks' slices of it were consumed
        by the reduce-scatter). Costs a copy of this rank's reduced slice meanwhile."""
        if self.state is not GradState.REDUCED:
            return
        if self.grads.slot.streamed:
            raise RuntimeError(
                f"{self.label}: a second backward() before step() on the micro-step that "
                "closes the accumulation window needs the reduced gradient in memory, but "
                "offload_optimizer nvme keeps it in a swap file; sum the losses and call "
                "backward() once, or run the earlier passes inside engine.no_sync()"
            )
        carried = self.grads.shard.clone()
        self._carried = carried if self._carried is None else self._carried + carried
        self.grads.zero()
        self.state = GradState.ACCUMULATING

    def _add_carried(self) -> None:
        if self._carried is not None:
            self.grads.shard.add_(self._carried)
            self._carried = None

    def full_gradient(self) -> torch.Tensor:
        """The gradient of the whole buffer in fp32 (stages 0-1): this rank's own after
        ``keep_local_gradient``, else the averaged one at stage 0."""
        if not isinstance(self.grads, FullGradients):
            raise InvariantError(f"{self!r}: no whole gradient kept")
        flat = self.grads.flat
        return flat if flat.dtype == torch.float32 else flat.float()

    def check_reduced(self) -> None:
        """Raise unless the gradient is ready for the optimizer."""
        if self.state is not GradState.REDUCED:
            raise InvariantError(f"{self!r}: optimizer step before its gradient was reduced")

    def start_next_window(self) -> None:
        """The optimizer consumed the gradient (or the step was skipped): zero it for the
        next window."""
        self.check_reduced()
        self.grads.zero()
        self.received.clear()
        self.state = GradState.ACCUMULATING
        self.off_device_grads.clear()
        if self._step_grad is not None:
            self._step_grad = None
            self._pieces_bound = False  # released by us, not by an optimizer's zero_grad()
            for piece in self.pieces:
                piece.param.grad = None

    def publish(self) -> None:
        """After an optimizer step: round the updated fp32 master into this rank's range of
        the parameters (before ``gather`` spreads it). A streamed master was published
        chunk by chunk by the offloaded step."""
        master = self.master_slot
        if master is None or master.streamed:
            return
        with held_in_memory((self.buffer.slot,), write_back=True):
            self.buffer.owned_slice(*self.master_range).copy_(master.tensor)

    def adopt_outside_changes(self, only_if_written: bool = False) -> torch.Tensor | None:
        """Where this rank's range of the parameters no longer holds what zerotrain last
        wrote (the master's rounding, or at stage 3 the permanent slice of a unit that is
        gathered), take the new values (``load_state_dict``, ``p.data`` writes, a clamp
        after each step, ``GatheredParameters`` with a ``modifier_rank``); unchanged
        elements keep their fp32 value. Returns how many elements changed (a 0-d tensor:
        reading it is left to the caller, as it syncs a GPU), or None when there was
        nothing to compare.

        Compared element by element, which also sees writes through ``p.data``.
        ``only_if_written`` (before every step): compare only when a parameter was given
        new storage (``p.data = t``) or written in place since the last comparison (its
        version counter moved), so a steady step does no device work here; writes through
        ``p.data`` then wait for an explicit call (``engine.parameters_changed()``).
        Stage-3 units that are not gathered have nothing visible to change.
        """
        master = self.master_slot
        if isinstance(self.buffer, FlatParamBuffer):
            if master is None:
                return None  # the optimizer steps the parameters themselves
            moved = self.buffer.readopt()
            if only_if_written and not moved and not self.written_in_place():
                return None
            self._versions = self._param_versions()
            if not master.resident:
                return None  # in a swap file: compared chunk by chunk by the offloaded step
            visible = self.buffer.owned_slice(*self.master_range)
            return take_changes(master.tensor, visible)
        if not self.buffer.gathered:
            return None
        if only_if_written and not self.written_in_place():
            return None
        self._versions = self._param_versions()
        lo, hi = self.owned
        changed = take_changes(self.buffer.shard, self.buffer.full[lo:hi])
        self.buffer.slot.write_back()  # a gathered unit's slice is resident
        if master is not None:
            # Gathered units are few (persistent ones, GatheredParameters): reading a master
            # kept in a file back for the comparison is cheap.
            with held_in_memory((master,), write_back=True):
                visible = self.buffer.owned_slice(*self.master_range)
                changed += take_changes(master.tensor, visible)
        return changed

    def release(self, run: Callable[[CollectiveIO], None]) -> None:
        """Give every parameter its own storage again, in the dtype it had before. With
        master weights the parameters get the fp32 master values, all-gathered through
        ``run`` (which issues and waits) when the master is partitioned; stage-3 units
        without them must be gathered first."""
        if self.master is None:
            self.buffer.release()
            return
        with self.resident(write_back=False):
            self._release_master(run)

    def _release_master(self, run: Callable[[CollectiveIO], None]) -> None:
        invariant(self.master is not None, "no master copy to release from")
        assert self.master is not None  # for the type checker; the invariant above raises
        self.adopt_outside_changes()  # what the user wrote since the last step counts
        lo, hi = self.owned
        mlo, mhi = self.master_range
        full = torch.zeros(self.buffer.layout.padded_numel, dtype=torch.float32, device=self.device)
        full[lo:hi].copy_(self.buffer.owned_slice(lo, hi))  # frozen parameters: as held
        full[mlo:mhi].copy_(self.master)
        if self.zero.shard_optimizer:
            run(CollectiveIO("all_gather", full, full[lo:hi], "parameters", self.label))
        if isinstance(self.buffer, PartitionedParams):
            self.buffer.detach()
        with torch.no_grad():
            for i, param in enumerate(self.buffer.params):
                param.data = self.buffer.view(full, i).to(self.model_dtypes[i], copy=True)
                param.grad = None

    def refresh(self) -> CollectiveIO | None:
        """After an optimizer step: the all-gather of the updated slices that gives every
        rank whole parameters again (stages 1-2, and stage-3 units that stay gathered), or
        None when there is nothing to spread."""
        if isinstance(self.buffer, PartitionedParams):
            # Gathered at step time: a persistent unit, or one held by GatheredParameters.
            return self.buffer.refresh(self.label) if self.buffer.gathered else None
        if not self.zero.shard_optimizer:
            return None
        lo, hi = self.owned
        data = self.buffer.data
        return CollectiveIO("all_gather", data, data[lo:hi], "parameters", self.label)

    def reset(self) -> None:
        """Forget a failed backward pass: no reduction pending, gradients zeroed."""
        self._step_grad = None
        self._carried = None
        self.grads.reset()
        self.received.clear()
        self.state = GradState.ACCUMULATING


# Elements compared at once: bounds the temporaries (3 bytes an element). On an
# accelerator larger, as each chunk costs five kernel launches per step: with 4M the
# comparison of a 354M-parameter GPT took 700 launches a step, its host time showing.
_COMPARE_CHUNK = 1 << 22
_COMPARE_CHUNK_ACCELERATOR = 1 << 24


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def take_changes(stored: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Copy into ``stored`` the elements of ``visible`` that differ from ``stored`` rounded
    to ``visible``'s dtype; returns their count (0-d tensor on ``stored``'s device).

    Compared bit for bit: what zerotrain wrote is that rounding exactly, NaNs included,
    and integer comparison needs no NaN masks (a GPU pays this every step, so its passes
    over memory count). On CPUs a chunk without changes is left unwritten (checking costs
    nothing there); on GPUs every chunk is rewritten in place through ``torch.where`` so
    that nothing waits for the device.
    """
    count = torch.zeros((), dtype=torch.int64, device=stored.device)
    on_cpu = stored.device.type == "cpu"
    chunk = _COMPARE_CHUNK if on_cpu else _COMPARE_CHUNK_ACCELERATOR
    with torch.no_grad():
        for lo in range(0, stored.numel(), chunk):
            mine = stored[lo : lo + chunk]
            seen = visible[lo : lo + chunk].to(mine.device)
            expected = mine if mine.dtype == seen.dtype else mine.to(seen.dtype)
            differ = _bits(seen) != _bits(expected)
            if on_cpu:
                if bool(differ.any()):
                    mine[differ] = seen[differ].to(mine.dtype)
                    count += differ.sum()
            else:
                torch.where(differ, seen, mine, out=mine)
                count += differ.sum()
    return count

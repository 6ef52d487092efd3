"""The ZeRO layer as the engine sees it: units, gradient reduction, and the bookkeeping
around each optimizer step (clipping over shards, parameters that got no gradient, and
re-gathering updated parameters).

One implementation for every stage: ``ZeroPolicy`` decides what the units partition, and
the rest of this module is the same code for stages 0 to 3. Stage 3 adds a
``ParamGatherer``, which gathers each unit around its use; at every accumulation boundary
the ranks compare what they gathered (riding on the exchange of used-parameter flags), so
ranks that took different code paths fail with an error naming the unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.comm.agreement import disagreements
from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import GradReducePolicy, PrecisionPolicy, Stage3Policy
from zerotrain.shard.io import CollectiveIO
from zerotrain.shard.unit import OptimizerPiece
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import LargeAllocationMapping
from zerotrain.zero.fused_wgrad import WeightGradFusion
from zerotrain.zero.gather import ParamGatherer
from zerotrain.zero.grad_norms import GradNorms
from zerotrain.zero.grad_sync import GradientSynchronizer
from zerotrain.zero.homes import Home, register, unregister
from zerotrain.zero.init import replaying
from zerotrain.zero.issue import issue, issue_all_gathers, reduce_batch_numel
from zerotrain.zero.outside_writes import OutsideWrites
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.units import TrainableParam, ValueLookup, build_module_units, build_units
from zerotrain.zero.unused_params import UsedParameters
from zerotrain.zero.window import BackwardWindow, PassPlan

if TYPE_CHECKING:
    from zerotrain.offload.manager import Offload

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Stage3Options:
    """What stage 3 needs beyond the other stages: the model, how to split it, the gather
    knobs, and (for models built by ``zerotrain.zero.Init``) where parameter values come
    from."""

    model: nn.Module
    policy: Stage3Policy
    values: ValueLookup | None = None


class ZeroStrategy:
    """Owns the units of one model and runs their side of every training step.

    Args:
        trainable: every parameter that receives gradients, tagged with its optimizer group.
        num_params: number of parameters of the model (ids run ``0 .. num_params - 1``).
        bucket_numel: elements per unit (None: sized from the model); at stage 3, the
            most a batch of small units' gradient reductions carries (``reduce_batch_numel``).
        comm: collectives over the data-parallel group.
        zero: what is partitioned.
        reduce: how gradients are averaged.
        stage3: the model and gather settings (required at stage 3).
        precision: compute, accumulation and reduction dtypes; master weights.
        offload: where optimizer states and parameters are offloaded (None: resident).
        distinct_axes: communicators across which the ranks hold gradients of *different*
            parameters (pipeline stages; tensor-parallel shards): the global gradient norm,
            and with it clipping and the fp16 overflow decision, sums over them too.
        isolate: stages 0-2: name prefixes whose parameters form a unit of their own each
            (see ``build_units``); stage 3 takes its units from the model.
        pad_multiple: stages 0-2: pad every unit's buffer to a multiple of this (the 1-bit
            all-reduce's chunks).
    """

    def __init__(
        self,
        trainable: Sequence[TrainableParam],
        num_params: int,
        bucket_numel: int | None,
        comm: Communicator,
        zero: ZeroPolicy,
        reduce: GradReducePolicy,
        stage3: Stage3Options | None = None,
        precision: PrecisionPolicy | None = None,
        offload: Offload | None = None,
        distinct_axes: Sequence[Communicator] = (),
        isolate: Sequence[str] = (),
        pad_multiple: int = 1,
    ) -> None:
        self.comm = comm
        self.distinct_axes = tuple(a for a in distinct_axes if a.world_size > 1)
        self.offload = offload
        self.zero = zero
        self.precision = precision or PrecisionPolicy()
        self.num_params = num_params
        if reduce.overlap is None:
            # On CPUs every core already computes, so a reduction running beside backward
            # only competes with it; waiting for each as it is launched is faster there.
            reduce = dataclasses.replace(reduce, overlap=comm.device.type == "cuda")
        self.gatherer: ParamGatherer | None = None
        self._mapping: LargeAllocationMapping | None = None
        host_master = offload is not None and offload.policy.optimizer != "none"
        if offload is not None:  # check space for and open the swap files first
            every = list(stage3.model.parameters()) if stage3 is not None else None
            offload.reserve_for([t.param for t in trainable], every, self.precision)
        if zero.shard_parameters:
            invariant(stage3 is not None, "stage 3 needs the model")
            assert stage3 is not None
            # A model built by zero.Init gets its values here, unit by unit. Such a model
            # is one that does not fit whole: large allocations stay mapped individually
            # (see utils.memory) while it trains, not only while it is built, so that the
            # unit buffers gathered and freed every step leave nothing in the C heap.
            self._mapping = replaying(stage3.values)
            try:
                self.units, self.pools, modules = build_module_units(
                    stage3.model,
                    trainable,
                    stage3.policy.unit_classes,
                    comm,
                    zero,
                    reduce,
                    stage3.values,
                    self.precision,
                    offload,  # where each unit's states live (None: in memory)
                    host_master,
                )
            except BaseException:
                if self._mapping is not None:
                    self._mapping.release()
                raise
            self.gatherer = ParamGatherer(self.units, modules, stage3.model, comm, stage3.policy)
            if offload is not None:
                self.gatherer.read_ahead = offload.param_read_ahead
        else:
            self.units, self.pools = build_units(
                trainable,
                bucket_numel,
                comm,
                zero,
                reduce,
                self.precision,
                offload,
                host_master,
                isolate,
                pad_multiple,
            )
            # Whole parameters: GatheredParameters(modifier_rank=...) broadcasts over comm.
            register(self._unit_params(), Home(comm))
        self.sync = GradientSynchronizer(
            self.units,
            comm,
            overlap=bool(reduce.overlap),
            every_micro_step=zero.shard_gradients,
            launch_when_complete=self.gatherer is None,
            on_outside_grad=self._drop_outside_grads_if_zeroed,
            coalesce_numel=reduce_batch_numel(bucket_numel) if self.gatherer is not None else 0,
        )
        self.pools += self.sync.pools
        if self.gatherer is not None:
            self.gatherer.on_backward_done = self.sync.mark_done
        self._fusion: WeightGradFusion | None = None
        self.window = BackwardWindow(whole_gradients=not zero.shard_gradients)
        self._pass = PassPlan()  # the current (or last) backward pass's
        self._placeholders: dict[int, torch.Tensor] = {}
        self.outside_writes = OutsideWrites(self.units)
        self.norms = GradNorms(self.units, comm, zero.shard_optimizer, self.distinct_axes)
        # Gradients summed over a group once per step (sequence-parallel LayerNorms and row
        # biases over the tensor group): per group, (unit, start, end) of the owned slices.
        self._group_sums: list[tuple[Communicator, list[tuple[int, int, int]]]] = []
        self.used = UsedParameters(self.units, comm, num_params, self.gatherer)

    # -- backward -------------------------------------------------------------------------------

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """Stage 3: whether units gathered for a backward pass are released at its end
        (True, the default) or stay gathered for the next micro-batch's forward and
        backward without gathering again, until a backward with True ends or the
        optimizer steps. Off trades memory (every unit used stays whole) for gathers.
        No effect at stages 0-2, whose parameters are never sharded."""
        if self.gatherer is not None:
            self.gatherer.reshard_after_backward = reshard

    def keep_gathered(self) -> None:
        """Stage 3: gather every unit now and keep it gathered (forwards and backwards do
        not release it) until :meth:`release_gathered`: one gather per unit for a whole
        pipeline step instead of two per micro-batch. No effect at stages 0-2."""
        if self.gatherer is not None:
            for u in range(len(self.units)):
                self.gatherer.pin(u)

    def release_gathered(self) -> None:
        """End :meth:`keep_gathered`: every unit is released."""
        if self.gatherer is not None:
            for u in range(len(self.units)):
                self.gatherer.unpin(u)
            self.gatherer.free_all()

    def begin_backward(self, boundary: bool) -> None:
        """Before autograd runs for one micro-step (``boundary``: its backward closes the
        accumulation window, unless ``window.set_is_last_backward`` said otherwise)."""
        self._pass = plan = self.window.plan(boundary)
        self._drop_outside_grads_if_zeroed()
        for unit in self.units:
            unit.attach_grads()
        if self.gatherer is not None:
            self.gatherer.begin_backward()
            self.sync.launch_last(self.gatherer.unsignalled)
        self.sync.begin_backward(plan.last_micro_step, requires_sync=plan.reduces)

    def backward_reaches_one_pass(self) -> None:
        """Every backward from now on starts from the outputs of one forward pass (a
        pipeline's micro-batch): at stage 3 a unit's reduction starts once the passes that
        backward reaches are done with it, not after every outstanding forward pass ran its
        backward (with 1F1B's micro-batches in flight, that was the end of backward)."""
        if self.gatherer is not None:
            self.gatherer.one_pass_per_backward = True

    def expect_no_gradient(self, params: Sequence[torch.Tensor]) -> None:
        """The next backward pass reaches none of ``params`` on any rank (layers dropped
        alike everywhere): their reductions need not wait for the end of backward."""
        self.sync.expect_no_gradient(params)

    def _drop_outside_grads_if_zeroed(self) -> None:
        # Gradients of backward passes outside the engine stay in param.grad, where
        # model.zero_grad() clears them as in plain PyTorch. The optimizer returned by
        # initialize holds this rank's pieces instead of the parameters: its zero_grad()
        # shows as dropped piece gradients, and means the same for the parameters.
        if any(unit.optimizer_grads_dropped() for unit in self.units):
            for unit in self.units:
                unit.drop_outside_grads()
                unit.forget_optimizer_grads()

    def end_backward(self) -> None:
        """After autograd finished: every reduction of this micro-step is complete."""
        try:
            self.sync.launch_remaining()
        except BaseException:
            self.abort_backward()  # a late gradient: the window is discarded, as for errors
            raise
        if self.gatherer is not None:
            self.gatherer.end_backward()
        if self._pass.closes:
            # Which parameters got a gradient is known now; exchanging it here runs behind
            # the gradient reductions instead of adding a round trip to the step.
            self.used.exchange()
        self.sync.wait()
        for unit in self.units:
            unit.detach_grads()
        if self._pass.closes and self._pass.local:
            policy = self.units[0].reduce_policy if self.units else None
            if policy is not None:
                # What the reduction divides by, less the ranks it averages over.
                ranks = policy.pre_divide * policy.post_divide / self.comm.world_size
                for unit in self.units:
                    unit.keep_local_gradient(ranks)

    def reopen_window(self) -> None:
        """Another backward pass follows the one that closed the accumulation window, before
        the step (DeepSpeed's several ``backward()`` calls per ``step()``): the units set
        their reduced gradients aside and accumulate anew (``ShardedUnit.reopen_window``);
        which parameters got a gradient is exchanged again at the end of that pass."""
        self.used.discard()
        for unit in self.units:
            unit.reopen_window()

    def abort_backward(self) -> None:
        """After autograd raised: discard the current window's gradients."""
        try:
            self.sync.abort()
        finally:
            for unit in self.units:
                unit.detach_grads()
            if self.gatherer is not None:
                self.gatherer.abort_backward()

    def zero_grads(self) -> None:
        """Zero every gradient in place (reduction state is kept), and clear what backward
        passes outside the engine left in ``param.grad``."""
        for unit in self.units:
            unit.grads.zero_values()
            unit.drop_outside_grads()

    # -- optimizer step -------------------------------------------------------------------------

    def reduced_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, one flat tensor per unit (for clipping: together
        over all ranks they hold each gradient element exactly once, or, at stage 0, every
        rank holds all of them)."""
        for unit in self.units:
            unit.check_reduced()
        return [u.grad_shard for u in self.units]

    def shard_norm_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """See ``GradNorms.shard_reducer``."""
        return self.norms.shard_reducer()

    def global_norm_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """See ``GradNorms.global_reducer``."""
        return self.norms.global_reducer()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (``GradNorms.global_norm``)."""
        return self.norms.global_norm(local=self._pass.local)

    def first_nonfinite_grad(self) -> str | None:
        """See ``GradNorms.first_nonfinite``."""
        return self.norms.first_nonfinite()

    def norm_squares(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's per-unit sums of squares behind the last ``grad_norm``."""
        return self.norms.last_squares

    def first_nonfinite_unit(self, squares: list[tuple[int, torch.Tensor]]) -> str | None:
        """See ``GradNorms.first_nonfinite_unit``."""
        return self.norms.first_nonfinite_unit(squares)

    def count_once_elsewhere(self, params: Iterable[torch.Tensor]) -> None:
        """See ``GradNorms.count_once_elsewhere``."""
        self.norms.count_once_elsewhere(params)

    def exclude_from_norm(self, units: Iterable[int]) -> None:
        """See ``GradNorms.exclude``."""
        self.norms.exclude(units)

    def sum_over_group_each_step(self, params: Sequence[torch.Tensor], comm: Communicator) -> None:
        """From now on, sum the reduced gradients of ``params`` over ``comm`` once per step
        (:meth:`sum_group_gradients`): parameters whole on every rank of ``comm`` whose
        gradients each rank computed from its own part of the data (Megatron's sequence
        parallelism). Collective over ``comm``: its ranks must hold these parameters at
        the same places of the same units, which is checked.

        Raises:
            ValueError: the ranks of ``comm`` lay these gradients out differently (the
                message names the first differing pieces).
            NotImplementedError: a unit's gradient is streamed from a swap file (NVMe).
        """
        ids = {id(p) for p in params}
        ranges: list[tuple[int, int, int]] = []
        names: list[tuple[str, str]] = []
        for k, unit in enumerate(self.units):
            lo, hi = unit.owned
            for param, spec in zip(unit.buffer.params, unit.buffer.layout.params, strict=True):
                a, b = max(lo, spec.start), min(hi, spec.end)
                if id(param) in ids and a < b:
                    if unit.grads.slot.streamed:
                        raise NotImplementedError(
                            f"{spec.fqn}: its gradient is kept in a swap file (NVMe offload), "
                            "and summing it over the tensor group each step needs it in memory"
                        )
                    ranges.append((k, a - lo, b - lo))
                    names.append((f"piece {len(names)}", f"{spec.fqn} unit {k} [{a}:{b}]"))
        differ = disagreements(comm, names)
        if differ:
            raise ValueError(
                "the tensor-parallel ranks lay out the gradients of their whole parameters "
                "differently, so they cannot be summed slice by slice: " + "; ".join(differ)
            )
        if ranges:
            self._group_sums.append((comm, ranges))

    def sum_group_gradients(self) -> None:
        """The sums of :meth:`sum_over_group_each_step`: one all-reduce per group of every
        piece of this rank's reduced gradients it covers (call once per step, after the
        reduction and before the norm)."""
        if not self._group_sums:
            return
        grads = self.reduced_grads()
        for comm, ranges in self._group_sums:
            pieces = [grads[k][a:b] for k, a, b in ranges]
            flat = torch.cat(pieces)
            comm.all_reduce(flat, purpose="sequence_parallel_gradients")
            torch._foreach_copy_(pieces, list(flat.split([p.numel() for p in pieces])))

    def units_under(self, prefix: str) -> list[int]:
        """Indices of the units whose parameters are all named under ``prefix``."""
        return [
            k
            for k, unit in enumerate(self.units)
            if all(p.fqn.startswith(prefix) for p in unit.buffer.layout.params)
        ]

    def scale_grads(self, coef: torch.Tensor | None) -> None:
        """Multiply the reduced gradients by ``coef`` (unscaling and clipping; None: leave
        them). Streamed slices are scaled by the offloaded step as it reads them."""
        if coef is not None:
            if self._pass.local:  # each rank's whole gradient, as the optimizer reads it
                resident = [u.grads.flat for u in self.units]  # type: ignore[union-attr]
            else:
                resident = [g for u in self.units for g in u.grads_to_scale()]
            if resident:
                torch._foreach_mul_(resident, coef.to(resident[0].device))
        if self.offload is not None and self.offload.optimizer is not None:
            self.offload.optimizer.grad_scale = coef

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer | None,
        steps_model_params: bool,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step ``optimizer`` on the reduced gradients, then start the next window.

        ``steps_model_params``: the optimizer holds the model's own parameters (a user
        optimizer at stage 0) rather than this strategy's flat pieces. ``found_inf``: the
        step's verdict left on the device, which the optimizer honours (stage 3 adds
        diverged gathers to it: ``UsedParameters.unused``).
        """
        unused = self.used.unused(found_inf)
        if self.gatherer is not None:
            self.gatherer.end_window()  # the step changes the shards units gather from
        self.outside_writes.adopt(only_if_written=True)
        if self.offload is not None:
            self.offload.settle()
        if optimizer is not None:
            if steps_model_params:
                for unit in self.units:
                    unit.bind_grads()
                for unit, index in unused:
                    unit.buffer.params[index].grad = None  # torch skips it, as without zerotrain
                optimizer.step()
                for unit in self.units:
                    unit.detach_grads()
            else:
                self._bind_optimizer_grads()
                why = getattr(optimizer, "steps_unused_because", None)
                untouched = (
                    self.used.stepped_anyway(unused, why)
                    if why
                    else self.used.untouched(unused, optimizer)
                )
                with torch.no_grad(), untouched:
                    optimizer.step()
        for unit in self.units:
            unit.start_next_window()
            unit.publish()
        self.refresh_params()

    def refresh_params(self) -> None:
        """All-gather every unit's updated slices, so every rank holds whole parameters
        again (stages 1-2, and stage-3 units that stay gathered); waits for them."""
        ios = [io for io in (unit.refresh() for unit in self.units) if io is not None]
        for handle in issue_all_gathers(self.comm, ios):
            handle.wait()

    def adopt_outside_changes(self) -> None:
        """Every unit takes in what was written outside the optimizer (a checkpoint is
        about to be written; ``OutsideWrites.adopt``)."""
        self.outside_writes.adopt()

    def resident(self, write_back: bool) -> contextlib.AbstractContextManager[None]:
        """Everything offloaded to files in memory for the duration (checkpoints);
        ``write_back``: store the values there afterwards in the files."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.resident(self.units, write_back)

    def skip_step(self) -> None:
        """Drop this window's gradients without updating anything (an overflow was found);
        the checks that close a window still run."""
        self.used.unused()
        if self.gatherer is not None:
            self.gatherer.end_window()
        for unit in self.units:
            unit.start_next_window()

    # -- moving states out of device memory (engine.offload_states) ----------------------------

    def offloadable_states(self) -> dict[str, list[torch.Tensor]]:
        """Every unit's state tensors under DeepSpeed's ``offload_states`` names (see
        ``ShardedUnit.offloadable_states``)."""
        states: dict[str, list[torch.Tensor]] = {}
        for unit in self.units:
            for name, tensors in unit.offloadable_states().items():
                states.setdefault(name, []).extend(tensors)
        return states

    def point_params(self, host: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
        """Parameters read from their host copy while offloaded, or (None) from the units
        again (``ShardedUnit.point_params``)."""
        for unit in self.units:
            unit.point_params(host)

    def take_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Empty every unit parameter's ``.grad``, returning what each held (while the
        gradient storage is offloaded, ``.grad`` reads None instead of freed memory)."""
        taken = []
        for param in self._unit_params():
            if param.grad is not None:
                taken.append((param, param.grad))
                param.grad = None
        return taken

    def drop_idle_staging(self) -> None:
        """Free the staging buffers no unit holds (DeepSpeed's ``contiguous_grad_buffer``);
        they are allocated again when a backward pass needs them."""
        for pool in self.pools:
            pool.drop_idle()

    # -- what the optimizer steps ---------------------------------------------------------------

    @property
    def optimizer_over_shards(self) -> bool:
        """Whether the optimizer must step this strategy's flat pieces (partitioned states,
        or fp32 master weights) rather than the model's own parameters."""
        return self.zero.shard_optimizer or self.precision.master_weights

    def pieces(self, group: int) -> list[OptimizerPiece]:
        """This rank's pieces of optimizer group ``group``, over all units."""
        return [p for unit in self.units for p in unit.pieces if p.group == group]

    def placeholder(self, group: int) -> torch.Tensor:
        """An empty tensor (with an empty gradient) standing in for optimizer group
        ``group`` on a rank that owns none of its elements."""
        if group not in self._placeholders:
            dtype = torch.float32
            if self.units and not self.precision.master_weights:
                dtype = self.units[0].buffer.dtype
            empty = torch.zeros(0, dtype=dtype, device=self.comm.device)
            empty.grad = torch.zeros_like(empty)
            self._placeholders[group] = empty
        return self._placeholders[group]

    def _bind_optimizer_grads(self) -> None:
        # An optimizer's zero_grad() (torch's default: set_to_none) drops these references;
        # without them every piece would be skipped as if it had no gradient.
        for unit in self.units:
            unit.bind_optimizer_grads()
        for empty in self._placeholders.values():
            if empty.grad is None:
                empty.grad = torch.zeros_like(empty)

    # -- accounting -----------------------------------------------------------------------------

    def param_bytes(self) -> int:
        """Bytes of the parameters this rank keeps (its slices at stage 3)."""
        return sum(u.buffer.nbytes for u in self.units)

    def gathered_bytes(self) -> tuple[int, int]:
        """Stage 3: bytes of parameters gathered now, and the most gathered at once."""
        if self.gatherer is None:
            return 0, 0
        return self.gatherer.live_bytes, self.gatherer.peak_bytes

    def grad_bytes(self) -> int:
        """Bytes of the gradients this rank accumulates (its slices at stages 2-3)."""
        return sum(u.grads.nbytes for u in self.units)

    def staging_bytes(self) -> int:
        """Bytes of the buffers gradients pass through on their way to a reduction."""
        return sum(p.nbytes for p in self.pools)

    def master_bytes(self) -> int:
        """Bytes of the fp32 master weights (mixed precision)."""
        return sum(u.master_nbytes for u in self.units)

    def _run_now(self, io: CollectiveIO) -> None:
        issue(self.comm, io, async_op=False)

    def _unit_params(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit.buffer.params]

    def managed(self) -> set[int]:
        """ids (``id()``) of the parameters inside units."""
        return {id(p) for unit in self.units for p in unit.buffer.params}

    def fuse_weight_grads(self, model: nn.Module) -> None:
        """``gradient_accumulation_fusion``: the model's ``nn.Linear`` layers add their
        weight gradients into the gradient buffer in place on micro-steps that reduce
        nothing (stages 0-1; stage 3 gathers and frees weights, so it has no such buffer)."""
        if self.gatherer is None and self._fusion is None:
            self._fusion = WeightGradFusion(model, self.sync.takes_in_place)

    def remove(self, restore_params: bool = True) -> None:
        """Detach hooks and give parameters their own storage back, with the fp32 master
        values under mixed precision (collective at stage 3, where every unit is gathered
        one last time, and wherever master weights are partitioned).

        ``restore_params=False`` leaves the parameters without values (stage 3: empty)
        instead: for models that fit only sharded or offloaded, whose whole values would
        not fit in memory.
        """
        self.sync.remove()
        if self._fusion is not None:
            self._fusion.remove()
            self._fusion = None
        if self.gatherer is not None:
            self.gatherer.remove()
        else:
            unregister(self._unit_params())
        if restore_params:
            # Unit by unit, so that only one unit is gathered besides the restored ones.
            for u, unit in enumerate(self.units):
                if self.gatherer is not None and unit.master is None:
                    self.gatherer.fetch(u)
                unit.release(self._run_now)
        if self.offload is not None:
            self.offload.close()
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None

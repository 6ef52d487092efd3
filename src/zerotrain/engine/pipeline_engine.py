"""The engine of a pipeline-parallel model: ``train_batch`` and ``eval_batch``.

A :class:`PipelineEngine` is an :class:`Engine` whose model is one pipeline stage (a
``PipelineModule`` holding this rank's layers) and whose step is a whole batch: the
schedule's instruction list runs ``gradient_accumulation_steps`` micro-batches through the
stages (``parallel/pipeline/executor.py``), then the step is the plain engine's (clip,
overflow skip, optimizer, LR schedule), agreed across stages because the gradient norm sums
over the pipe axis.

ZeRO runs inside each stage's data-parallel group. When its gradients are reduced is the
``pipeline.grad_reduce`` policy:

* ``end_of_step`` (default): every backward accumulates locally; the stage reduces once,
  at its ``REDUCE_GRAD`` action after its last backward. One reduction per step (the
  traffic of plain data parallelism); at stages 2-3 each rank holds a full-size gradient of
  its stage until then.
* ``per_microbatch``: every micro-batch's backward reduce-scatters (stages 2-3: a sharded
  gradient only, M times the traffic). Stage 1 keeps whole gradients by definition and
  reduces once per step either way.

At stage 3, ``pipeline.reshard_after_forward`` true (default) releases each layer's
gathered parameters after its forward and gathers them again for its backward (least
memory; two gathers per micro-batch); false gathers the stage once per step and keeps it
gathered through every micro-batch (one gather per step; the stage's full parameters live).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from zerotrain.config.policies import PipelinePolicy
from zerotrain.engine.engine import Engine
from zerotrain.engine.state_offload import FORWARD, STEP
from zerotrain.parallel.pipeline import messages
from zerotrain.parallel.pipeline.builders import build_schedule
from zerotrain.parallel.pipeline.executor import PipelineExecutor
from zerotrain.parallel.pipeline.module import PipelineModule
from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.parallel.pipeline.ties import TiedGroup, sum_gradient_slices
from zerotrain.precision.casts import cast_floating

_BACKWARDS = (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)
_RAN_OUT = 2  # a stage's failure code when its data iterator ran out (other failures: 1)


class PipelineEngine(Engine):
    """An :class:`Engine` over one pipeline stage; built by :func:`zerotrain.initialize`
    for a ``PipelineModule``. Train with :meth:`train_batch` (``forward``/``backward``/
    ``step`` work only with a single stage)."""

    def __init__(
        self,
        *args: Any,
        pipeline: PipelinePolicy,
        schedule: PipelineSchedule,
        ties: Sequence[TiedGroup],
        **kwargs: Any,
    ) -> None:
        """As :class:`Engine`, plus the pipeline policy, this job's schedule (with
        communication) and the tie groups this rank is in."""
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline
        self.schedule = schedule
        self.ties = list(ties)
        if not isinstance(self.module, PipelineModule):
            raise TypeError(
                f"a PipelineEngine trains a PipelineModule, got {type(self.module).__name__}"
            )
        self.executor = PipelineExecutor(self.module, self.groups.pipe, schedule)
        mine = schedule.actions[self.groups.pipe.rank]
        backwards = [a for a in mine if a.kind in _BACKWARDS]
        self._last_backward = backwards[-1] if backwards else None
        reduces = [a for a in mine if a.kind is ActionType.REDUCE_GRAD]
        self._last_reduce = reduces[-1] if reduces else None
        self._data_iterator: Iterator[Any] | None = None
        # Why an earlier step failed part-way: messages and gradients are then in an unknown
        # state, so later steps are refused.
        self._failed: str | None = None
        for group in self.ties:
            if not group.owner:
                self.strategy.exclude_from_norm(self.strategy.units_under(group.prefix))
        self._elsewhere = _parameters_of_other_chunks(self.module)
        self.strategy.backward_reaches_one_pass()  # each backward: one micro-batch's chunk

    # -- DeepSpeed's pipeline queries ---------------------------------------------------------

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (stages per pipeline, not counting virtual stages)."""
        return self.groups.pipe.world_size

    @property
    def stage_id(self) -> int:
        """This rank's place in its pipeline."""
        return self.groups.pipe.rank

    def is_first_stage(self) -> bool:
        """Whether this rank reads the inputs (it holds stage 0)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (it holds the last stage)."""
        return self.schedule.stage_to_rank(self.schedule.num_stages - 1) == self.stage_id

    # -- the single-stage path ----------------------------------------------------------------

    def _refuse_split(self, what: str) -> None:
        if self.num_stages > 1:
            raise RuntimeError(
                f"engine.{what}() runs a whole model, but this one is split into "
                f"{self.num_stages} pipeline stages: call engine.train_batch(data_iter) "
                "(or eval_batch) instead"
            )

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: a compiled pipeline stage is untested (its executor calls the stage
        module per micro-batch and chunk)."""
        raise NotImplementedError(
            "engine.compile() on a pipeline is not supported yet: the stages' executor is "
            "untested with compiled layers; train the pipeline eagerly"
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The whole model's forward (a single stage only)."""
        self._refuse_split("forward")
        return super().forward(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """As :meth:`Engine.backward` (a single stage only)."""
        self._refuse_split("backward")
        return super().backward(loss, retain_graph, scale_wrt_gas)

    def step(self) -> None:
        """As :meth:`Engine.step` (a single stage only)."""
        self._refuse_split("step")
        super().step()

    # -- batches ----------------------------------------------------------------------------

    def set_dataiterator(self, iterator: Iterable[Any]) -> None:
        """The iterator ``train_batch()`` reads when called without one (DeepSpeed's name)."""
        self._data_iterator = iter(iterator)

    def _next_batches(self, data_iter: Iterable[Any] | None, count: int) -> list[Any]:
        if data_iter is None:
            if self._data_iterator is None:
                if self.training_dataloader is None:
                    raise ValueError(
                        "train_batch() without data_iter needs training_data passed to "
                        "initialize, or engine.set_dataiterator(...)"
                    )
                self._data_iterator = _repeating(self.training_dataloader)
            source: Iterator[Any] = self._data_iterator
        else:
            source = iter(data_iter)
        batches = []
        for m in range(count):
            try:
                batch = next(source)
            except StopIteration:
                # StopIteration still, as DeepSpeed's users catch it to end their loop.
                raise StopIteration(
                    f"the data iterator ran out after {m} of the {count} micro-batches of a "
                    "step (gradient_accumulation_steps)"
                ) from None
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(
                    "each micro-batch of a pipeline must be an (inputs, labels) pair, as in "
                    f"DeepSpeed; got {type(batch).__name__}"
                )
            batches.append(batch)
        return batches

    def _micro_batches(
        self, data_iter: Iterable[Any] | None, count: int
    ) -> tuple[list[Any] | None, list[Any] | None, list[int]]:
        """``count`` micro-batches: only the first and last stages read data; every stage
        learns the shapes' fingerprints and whether reading failed anywhere (one small
        all-reduce over the pipe group), so a stage that ran out of data or read a
        malformed batch stops every stage, instead of leaving the others waiting."""
        inputs = labels = None
        codes = torch.zeros(
            count + self.num_stages, dtype=torch.int64, device=self.groups.pipe.device
        )
        error: BaseException | None = None
        try:
            if self.is_first_stage() or self.is_last_stage():
                batches = self._next_batches(data_iter, count)
                if self.efficiency is not None:  # the curriculum's length, on both ends
                    batches = [self.efficiency.truncate_pair(b, self.global_steps) for b in batches]
                if self.is_first_stage():
                    inputs = [b[0] for b in batches]
                    dtype = self.precision.compute
                    if dtype is not None and self.precision.cast_inputs:
                        inputs = [cast_floating(x, dtype) for x in inputs]  # as engine(x) does
                    for m, x in enumerate(inputs):
                        where = f"micro-batch {m}'s inputs"
                        codes[m] = messages.signature(messages.as_tensors(x, where))
                if self.is_last_stage():
                    labels = [b[1] for b in batches]
        except Exception as exc:  # any failure to read: every stage stops together
            error = exc
            codes[count + self.stage_id] = _RAN_OUT if isinstance(exc, StopIteration) else 1
        if self.num_stages > 1:
            self.groups.pipe.all_reduce(codes, purpose="control")
        failed = [s for s in range(self.num_stages) if codes[count + s]]
        if error is not None:
            raise error
        if any(codes[count + s] == _RAN_OUT for s in failed):
            raise StopIteration(f"the data ran out on pipeline stage(s) {failed}")
        if failed:
            raise RuntimeError(
                f"pipeline stage(s) {failed} could not read this step's micro-batches (see "
                "their error: the data ran out, or a batch was not an (inputs, labels) pair "
                "of tensors); every stage stops"
            )
        return inputs, labels, [int(c) for c in codes[:count].tolist()]

    def train_batch(self, data_iter: Iterable[Any] | None = None) -> torch.Tensor:
        """Train on one batch: ``gradient_accumulation_steps`` micro-batches through every
        stage, then one optimizer step. Returns the batch's mean loss (over micro-batches
        and data-parallel ranks) on every rank.

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches; read only on the first
                stage (inputs) and the last (labels). Default: ``training_data`` given to
                initialize (repeated), or ``set_dataiterator``.
        """
        self._refuse_after_failure()
        self._states.require(STEP, "train_batch()")
        self.module.train()
        count = self.policy.batch.gradient_accumulation_steps
        inputs, labels, signatures = self._micro_batches(data_iter, count)
        self.telemetry.before_forward(self)
        held = self.policy.stage == 3 and not self.pipeline.reshard_after_forward
        if held:
            self.strategy.keep_gathered()
        try:
            losses = self.executor.run(
                inputs, labels, signatures, backward=self._backward, reduce_grad=self._reduce
            )
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.strategy.window.set_requires_gradient_sync(True)
            self.strategy.window.set_is_last_backward(None)
            if held:
                self.strategy.release_gathered()
        self._sync_ties()
        with self.telemetry.phase("step"):
            self._update()
        batch = self.policy.batch
        self.micro_steps += batch.gradient_accumulation_steps
        self.global_samples += batch.train_batch_size
        self.global_steps += 1
        loss = self._batch_loss(losses)
        self.loss_window.add(loss)
        step_losses = self.loss_window.end_step()
        self.telemetry.after_step(self, step_losses)
        if self.lr_find is not None:
            self.lr_find.after_step(self, step_losses)
        return loss

    @torch.no_grad()
    def eval_batch(
        self,
        data_iter: Iterable[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor:
        """The mean loss of one batch in eval mode, without gradients, returned on every
        rank (DeepSpeed's signature).

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches (first and last stage).
            num_micro_batches: micro-batches in the batch (default
                ``gradient_accumulation_steps``; the interleaved schedule needs a multiple
                of the stages).
            return_logits, compute_loss, reduce_output, bcast_loss: only DeepSpeed's
                defaults are supported (False, True, "avg", True); others raise.
        """
        self._refuse_after_failure()
        self._states.require(FORWARD, "eval_batch()")
        given = {
            "return_logits": (return_logits, False),
            "compute_loss": (compute_loss, True),
            "reduce_output": (reduce_output, "avg"),
            "bcast_loss": (bcast_loss, True),
        }
        for name, (value, default) in given.items():
            if value != default:
                raise NotImplementedError(
                    f"eval_batch({name}={value!r}) is not supported; the mean loss is "
                    f"returned on every rank ({name}={default!r})"
                )
        count = num_micro_batches or self.policy.batch.gradient_accumulation_steps
        schedule = self._eval_schedule(count)
        was_training = self.module.training
        self.module.eval()
        try:
            inputs, labels, signatures = self._micro_batches(data_iter, count)
            try:
                losses = self.executor.run(
                    inputs, labels, signatures, backward=None, schedule=schedule
                )
            except BaseException as exc:  # its messages are in as unknown a state as training's
                self._fail(exc)
                raise
        finally:
            self.module.train(was_training)
        return self._batch_loss(losses)

    def _eval_schedule(self, count: int) -> PipelineSchedule:
        """The training schedule's kind for ``count`` micro-batches (its forward actions
        run; 1F1B's need for M >= P does not apply without backwards, so GPipe's order
        stands in for it)."""
        if count == self.schedule.num_microbatches:
            return self.schedule
        name = self.schedule.name if self.schedule.virtual_stages > 1 else "gpipe"
        return build_schedule(
            name, self.num_stages, count, self.schedule.virtual_stages
        ).with_communication()

    def _fail(self, exc: BaseException) -> None:
        """A step failed part-way: drop this window's gradients and refuse later steps."""
        self._failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self.strategy.abort_backward()

    def _refuse_after_failure(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"an earlier train_batch/eval_batch failed part-way ({self._failed}): the "
                "pipeline's messages and this step's gradients are in an unknown state, so "
                "this engine cannot go on; restart from the last checkpoint"
            )

    def _batch_loss(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """The last stage's mean loss, averaged over its data-parallel group (times the
        sequence group: under Ulysses each rank's loss is its slice's share), on every rank
        of the pipeline."""
        value = torch.zeros((), dtype=torch.float32, device=self.groups.pipe.device)
        if losses:
            value = torch.stack([losses[m].float() for m in sorted(losses)]).mean()
            replicas = self.groups.zero
            if replicas.world_size > 1:
                replicas.all_reduce(value, purpose="control")
                value /= replicas.world_size
        if self.num_stages > 1:
            last = self.schedule.stage_to_rank(self.schedule.num_stages - 1)
            self.groups.pipe.broadcast(value, src=last, purpose="control")
        return value

    # -- the engine's side of the executor ----------------------------------------------------

    def _backward(
        self,
        roots: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        action: Action,
    ) -> None:
        """One backward action: the gradient-sync knobs from the policy, loss scaling on the
        last stage, autograd between the strategy's begin/end."""
        last = action == self._last_backward
        if self.pipeline.grad_reduce == "per_microbatch":
            # Once per micro-batch: at the rank's lowest stage, the last to run backward
            # for it (interleaved ranks hold several); what higher stages accumulated for
            # it is reduced then too.
            sync = action.stage == self.stage_id or last  # its lowest stage is its rank
        else:
            sync = False  # everything reduces at REDUCE_GRAD
        final = last and sync
        strategy = self.strategy
        strategy.window.set_requires_gradient_sync(sync)
        strategy.window.set_is_last_backward(final)
        if sync and action.stage in self._elsewhere:
            strategy.expect_no_gradient(self._elsewhere[action.stage])
        if grads is None:
            roots = [self._scaled_loss(roots[0])]

        def run() -> None:
            if roots:
                torch.autograd.backward(roots, grads)

        self._backward_pass(final, run)

    def _reduce(self, action: Action) -> None:
        """``REDUCE_GRAD``: with ``end_of_step``, the rank's one reduction of the step (its
        last such action; an interleaved rank has one per stage it holds)."""
        if self.pipeline.grad_reduce != "end_of_step" or action != self._last_reduce:
            return
        self.strategy.window.set_requires_gradient_sync(True)
        self.strategy.window.set_is_last_backward(True)
        # No autograd runs: ending the pass launches every unit's reduction.
        self._backward_pass(True, lambda: None)

    def _sync_ties(self) -> None:
        """Sum the copies' gradients of each tied module; a tied parameter is used when
        any stage used it."""
        if not self.ties:
            return
        grads = self.strategy.reduced_grads()
        units = {group.key: self.strategy.units_under(group.prefix) for group in self.ties}
        sum_gradient_slices(self.ties, {k: [grads[u] for u in us] for k, us in units.items()})
        for group in self.ties:
            self.strategy.used.share(units[group.key], group.comm)


def _repeating(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader`` epoch after epoch."""
    while True:
        yield from loader


def _parameters_of_other_chunks(module: PipelineModule) -> dict[int, list[torch.Tensor]]:
    """Per stage of this rank: the parameters only its other chunks use. A backward of one
    chunk reaches none of them, so under ``per_microbatch`` its reductions need not wait for
    them: without this, the syncing backward (the rank's lowest stage) stalled on the first
    unit in reduction order, a higher chunk's, and every reduction waited for the end of
    backward (review 2026-11-28, P7)."""
    if module.virtual_stages == 1:
        return {}
    used = [module.chunk_parameters(k) for k in range(module.virtual_stages)]
    out: dict[int, list[torch.Tensor]] = {}
    for k, stage in enumerate(module.local_chunks()):
        mine = {id(p) for p in used[k]}
        out[stage] = [
            p for j, params in enumerate(used) if j != k for p in params if id(p) not in mine
        ]
    return out

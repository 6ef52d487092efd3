"""The training-efficiency features at ``initialize`` and in each training forward:
progressive layer drop, the sequence-length curriculum (legacy ``curriculum_learning`` or
``data_efficiency``'s seqlen metric) and random-LTD.

At ``initialize`` (before stage-3 units are built) the model's block stack is found and the
blocks made to drop themselves or their tokens (``zerotrain.efficiency``). Each training
forward then draws this micro-step's decisions (the same on every data-parallel rank), tells
the stage-3 gatherer which blocks will not run, cuts the batch to the curriculum's length,
and passes DeepSpeed's keyword arguments (``progressive_layer_drop``/``pld_theta``,
``curriculum_seqlen``) to a model whose forward takes them.

Who drops layers under ``progressive_layer_drop`` (``initialize`` logs which way it took):

1. A forward with ``progressive_layer_drop`` and ``pld_theta`` parameters gets them every
   training forward and drops its own layers, as DeepSpeed's models do.
2. Otherwise zerotrain drops blocks itself where it finds a block list (known block
   classes, or those named in ``progressive_layer_drop.block_types``): the model is called
   without the two arguments.
3. Otherwise a forward that takes ``**kwargs`` gets them there, as DeepSpeed passes them
   (its ``PLD_SimpleModel`` and bing_bert read ``kwargs["pld_theta"]``).
4. Otherwise ``initialize`` refuses, saying both ways out.

Rule 2 comes before 3 because a forward's ``**kwargs`` often only passes arguments on
(transformers' models do), and those would then never drop anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from zerotrain.config.efficiency import (
    CurriculumLearningConfig,
    CurriculumMetricConfig,
    RandomLTDConfig,
)
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.efficiency.blocks import NoBlockStackError, find_block_stack
from zerotrain.efficiency.curriculum import truncate_call
from zerotrain.efficiency.layer_drop import (
    ProgressiveLayerDrop,
    apply_layer_drop,
    remove_layer_drop,
)
from zerotrain.efficiency.random_ltd import RandomLTD, apply_random_ltd, remove_random_ltd
from zerotrain.efficiency.schedules import CurriculumSchedule, RandomLTDSchedule
from zerotrain.parallel.groups import ProcessGroups
from zerotrain.parallel.pipeline.module import PipelineModule
from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)


@dataclass
class TrainingEfficiency:
    """The active features of one engine and what its model's forward accepts."""

    layer_drop: ProgressiveLayerDrop | None = None
    curriculum: CurriculumSchedule | None = None
    random_ltd: RandomLTD | None = None
    pass_pld: bool = False  # the model's forward takes progressive_layer_drop / pld_theta
    pass_seqlen: bool = False  # ... and curriculum_seqlen
    dropping_blocks: list[nn.Module] = field(default_factory=list)
    token_dropping_blocks: list[nn.Module] = field(default_factory=list)

    def before_forward(
        self, engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """This micro-step's draws and the call's arguments (training forwards only)."""
        if not engine.module.training:
            return args, kwargs
        if self.layer_drop is not None:
            self.layer_drop.sync(engine.global_steps)  # also right after a checkpoint load
            if self.pass_pld:
                kwargs = {**kwargs, **self.layer_drop.get_state()}
            else:
                dropped = self.layer_drop.begin_forward(engine.micro_steps)
                gatherer = engine.strategy.gatherer
                if gatherer is not None:
                    gatherer.skip_in_next_pass(dropped)
                engine.strategy.expect_no_gradient(self.layer_drop.dropped_params())
        if self.curriculum is not None:
            length = self.curriculum.update(engine.global_steps + 1)
            args, kwargs = truncate_call(args, kwargs, length)
            if self.pass_seqlen:
                kwargs = {**kwargs, "curriculum_seqlen": length}
        if self.random_ltd is not None:
            self.random_ltd.begin_forward(engine.global_steps, engine.micro_steps)
        return args, kwargs

    def truncate_pair(self, batch: Any, global_steps: int) -> Any:
        """A pipeline's ``(inputs, labels)`` micro-batch cut to the curriculum's length."""
        if self.curriculum is None:
            return batch
        length = self.curriculum.update(global_steps + 1)
        (cut,), _ = truncate_call((batch,), {}, length)
        return cut

    def remove(self) -> None:
        """Give the blocks back their own classes (``engine.destroy``)."""
        remove_layer_drop(self.dropping_blocks)
        remove_random_ltd(self.token_dropping_blocks)
        self.dropping_blocks, self.token_dropping_blocks = [], []


class EfficiencyQueries:
    """DeepSpeed's engine accessors of these features."""

    efficiency: TrainingEfficiency | None
    global_steps: int

    def get_pld_theta(self) -> float | None:
        """Progressive layer drop's current theta (None when it is off)."""
        pld = self.efficiency.layer_drop if self.efficiency is not None else None
        if pld is None:
            return None
        pld.sync(self.global_steps)
        return pld.get_theta()

    @property
    def curriculum_seqlen(self) -> int | None:
        """The curriculum's current sequence length (None when it is off)."""
        curriculum = self.efficiency.curriculum if self.efficiency is not None else None
        return curriculum.current if curriculum is not None else None

    def set_custom_curriculum_learning_schedule(
        self, schedule: Callable[[int], int] | dict[str, Callable[[int], int]]
    ) -> None:
        """The callback of a ``custom`` curriculum schedule: global step -> sequence length.
        DeepSpeed's data_efficiency form, a dict of metric name -> callback, is accepted."""
        curriculum = self.efficiency.curriculum if self.efficiency is not None else None
        if curriculum is None or curriculum.schedule_type != "custom":
            raise RuntimeError(
                "set_custom_curriculum_learning_schedule needs a curriculum with "
                "schedule_type 'custom' in the config"
            )
        if isinstance(schedule, dict):
            if len(schedule) != 1:
                raise ValueError(f"one callback per curriculum metric; got {sorted(schedule)}")
            (schedule,) = schedule.values()
        curriculum.set_custom(schedule)


def _takes(model: nn.Module, *names: str) -> bool:
    """Whether ``model.forward`` has parameters called ``names`` (by name, not **kwargs)."""
    params = inspect.signature(model.forward).parameters
    return all(name in params for name in names)


def _takes_any_keyword(model: nn.Module) -> bool:
    """Whether ``model.forward`` has a ``**kwargs`` parameter."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _curriculum(cfg: ZeroTrainConfig) -> CurriculumSchedule | None:
    section: CurriculumLearningConfig | CurriculumMetricConfig | None = None
    if cfg.curriculum_learning is not None and cfg.curriculum_learning.enabled:
        section = cfg.curriculum_learning
    elif cfg.data_efficiency is not None:
        metric = cfg.data_efficiency.seqlen_curriculum()
        section = metric[1] if metric is not None else None
    if section is None:
        return None
    params = section.schedule_config
    return CurriculumSchedule(
        min_difficulty=int(section.min_difficulty or 0),
        max_difficulty=int(section.max_difficulty or 0),
        schedule_type=str(section.schedule_type),
        total_step=params.total,
        difficulty_step=params.difficulty_step,
        root_degree=params.root_degree,
        difficulty=tuple(params.difficulty or ()),
        max_step=tuple(params.max_step or ()),
    )


def refuse_split(feature: str, model: nn.Module, groups: ProcessGroups, note: str = "") -> None:
    """Raise when the job splits layers or heads (tensor, sequence or pipeline parallelism),
    which ``feature`` (built for whole layers) does not handle yet."""
    splits = {
        "tensor": groups.tensor.world_size,
        "sequence": groups.sequence.world_size,
        "pipe": groups.pipe.world_size,
    }
    used = [f"{name} parallel size {size}" for name, size in splits.items() if size > 1]
    if used or isinstance(model, PipelineModule):
        raise ValueError(
            f"{feature} runs with data parallelism (any ZeRO stage) only; this job has "
            f"{', '.join(used) or 'a PipelineModule'}{note}"
        )


_CURRICULUM_NOTE = " (the curriculum works with all of them)"


def _random_ltd(
    model: nn.Module,
    section: RandomLTDConfig,
    cfg: ZeroTrainConfig,
    groups: ProcessGroups,
    train_batch_size: int,
) -> tuple[RandomLTD, list[nn.Module]]:
    where = "data_efficiency.data_routing.random_ltd"
    if section.layer_token_lr_schedule.enabled:
        raise NotImplementedError(
            f"{where}.layer_token_lr_schedule: DeepSpeed never implemented it (it raised "
            "NotImplementedError); use the scheduler section"
        )
    refuse_split(where, model, groups, _CURRICULUM_NOTE)
    path, stack = find_block_stack(model, section.block_types, where)
    if section.total_layer_num != len(stack):
        raise ValueError(
            f"{where}.total_layer_num is {section.total_layer_num}, but the model's block "
            f"list {path!r} has {len(stack)} layers"
        )
    sched = section.random_ltd_schedule
    if sched is None:
        raise ValueError(f"{where}.random_ltd_schedule is required")
    schedule = RandomLTDSchedule(
        min_value=sched.min_value,
        max_value=sched.max_value,
        require_steps=sched.schedule_config.require_steps,
        seq_per_step=sched.schedule_config.seq_per_step,
        total_layers=len(stack),
        ltd_layers=len(section.random_ltd_layer_id),
        global_batch_size=train_batch_size,
    )
    seed = cfg.data_efficiency.seed if cfg.data_efficiency is not None else 1234
    controller = RandomLTD(
        schedule,
        seed,
        batch_first=section.hidden_state_order == "batch_seq_dim",
        mask_name=section.model_mask_name,
        dp_rank=groups.data.rank,
        dp_world_size=groups.data.world_size,
    )
    chosen = apply_random_ltd(list(stack), section.random_ltd_layer_id, controller)
    log.info(
        "random_ltd: layers %s of %r drop tokens (%d -> %d kept over %d steps)",
        sorted(section.random_ltd_layer_id),
        path,
        sched.min_value,
        sched.max_value,
        sched.schedule_config.require_steps,
    )
    return controller, chosen


def setup_training_efficiency(
    model: nn.Module, cfg: ZeroTrainConfig, groups: ProcessGroups, train_batch_size: int
) -> TrainingEfficiency | None:
    """Apply the config's efficiency sections to ``model`` (None when none is on).

    Raises:
        ValueError: the model has no block stack to act on, the layer counts disagree, or
            layer drop / random-LTD meet tensor, sequence or pipeline parallelism.
        NotImplementedError: random-LTD's layer_token_lr_schedule.
    """
    pld = cfg.progressive_layer_drop
    ltd = cfg.data_efficiency.random_ltd() if cfg.data_efficiency is not None else None
    result = TrainingEfficiency(curriculum=_curriculum(cfg))
    if pld is not None and pld.enabled and ltd is not None:
        raise ValueError(
            "progressive_layer_drop and data_efficiency random_ltd both drop work from the "
            "same blocks; enable one of them"
        )
    if pld is not None and pld.enabled:
        result.layer_drop = ProgressiveLayerDrop(pld.theta, pld.gamma, pld.seed)
        # The rule is in the module's docstring.
        stack: nn.ModuleList | None = None
        if _takes(model, "progressive_layer_drop", "pld_theta"):
            result.pass_pld = True
            log.info(
                "progressive_layer_drop: the model's forward takes pld_theta by name and "
                "drops its own layers"
            )
        else:
            refuse_split("progressive_layer_drop", model, groups, _CURRICULUM_NOTE)
            try:
                path, stack = find_block_stack(model, pld.block_types, "progressive_layer_drop")
            except NoBlockStackError as exc:
                if not _takes_any_keyword(model):
                    raise ValueError(
                        f"{exc}; or give the model's forward progressive_layer_drop and "
                        "pld_theta arguments (by name or through **kwargs) to drop its own "
                        "layers, as DeepSpeed's models do"
                    ) from exc
                result.pass_pld = True
                log.info(
                    "progressive_layer_drop: no block list in %s, and its forward takes "
                    "**kwargs: passing progressive_layer_drop and pld_theta there each "
                    "training forward, as DeepSpeed does (the model drops its own layers)",
                    type(model).__name__,
                )
        if stack is not None:
            apply_layer_drop(list(stack), result.layer_drop, model)
            result.dropping_blocks = list(stack)
            log.info(
                "progressive_layer_drop: %d blocks of %r (theta %g, gamma %g)",
                len(stack),
                path,
                pld.theta,
                pld.gamma,
            )
    if ltd is not None:
        result.random_ltd, result.token_dropping_blocks = _random_ltd(
            model, ltd, cfg, groups, train_batch_size
        )
    if result.curriculum is not None:
        result.pass_seqlen = _takes(model, "curriculum_seqlen")
        log.info(
            "curriculum: sequence length %d -> %d (%s)",
            result.curriculum.min_difficulty,
            result.curriculum.max_difficulty,
            result.curriculum.schedule_type,
        )
    active = (result.layer_drop, result.curriculum, result.random_ltd)
    return result if any(x is not None for x in active) else None

"""Config sections of the training-efficiency features: ``progressive_layer_drop``, the legacy
``curriculum_learning`` block and the newer ``data_efficiency`` section (its seqlen
curriculum and ``random_ltd``).

Keys, defaults and required-when-enabled keys are DeepSpeed 0.19.5's (0.19.8 removed
progressive layer drop and the legacy curriculum block; zerotrain keeps both). A disabled
section is checked for unknown keys and value types only: DeepSpeed never read one, and
configs ship with placeholders in sections they leave off.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from zerotrain.config.types import (
    Bool,
    Float,
    Int,
    LooseSection,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
)

CurriculumScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]

# The keys each schedule type reads (DeepSpeed asserts them when the scheduler is built).
_SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop`` (DeepSpeed's PLD, https://arxiv.org/abs/2010.13369).

    ``theta``: the keep probability of the last layer once the schedule has settled (1.0,
    the default, drops nothing); ``gamma``: how fast it gets there, theta(t) =
    (1 - theta) * exp(-gamma * t) + theta. zerotrain adds ``seed`` (the drop draws; every
    rank makes the same ones) and ``block_types`` (class names of pre-LN blocks to wrap
    besides the ones zerotrain knows: the demo GPT's, transformers' GPT-2 and Llama blocks).
    """

    enabled: Bool = False
    theta: Annotated[Float, Field(ge=0, le=1)] = 1.0
    gamma: NonNegativeFloat = 0.001
    seed: NonNegativeInt = 0
    block_types: list[str] = Field(default_factory=list)


class CurriculumScheduleParams(Section):
    """``schedule_config`` of a curriculum: which keys apply depends on ``schedule_type``.
    ``total_step`` is the legacy spelling of ``total_curriculum_step`` (DeepSpeedExamples'
    Megatron-LM curriculum configs use it)."""

    total_curriculum_step: PositiveInt | None = None
    total_step: PositiveInt | None = None
    difficulty_step: PositiveInt | None = None
    root_degree: PositiveFloat | None = None
    difficulty: list[Int] | None = None
    max_step: list[Int] | None = None

    @model_validator(mode="after")
    def _one_total(self) -> CurriculumScheduleParams:
        if self.total_step is not None and self.total_curriculum_step is not None:
            raise ValueError("give total_curriculum_step or its legacy alias total_step, not both")
        return self

    @property
    def total(self) -> int | None:
        """``total_curriculum_step``, whichever spelling gave it."""
        return self.total_curriculum_step if self.total_step is None else self.total_step


class _CurriculumSchedule(Section):
    """What a difficulty schedule needs: range, type and its parameters."""

    min_difficulty: Int | None = None
    max_difficulty: Int | None = None
    schedule_type: CurriculumScheduleType | None = None
    schedule_config: CurriculumScheduleParams = Field(default_factory=CurriculumScheduleParams)

    def _check_schedule(self) -> None:
        low, high = self.min_difficulty, self.max_difficulty
        missing = [k for k in ("min_difficulty", "max_difficulty") if getattr(self, k) is None]
        missing += ["schedule_type"] if self.schedule_type is None else []
        if missing or low is None or high is None:
            raise ValueError(f"an enabled curriculum needs {', '.join(missing)}")
        if not 0 < low <= high:
            raise ValueError(
                f"min_difficulty ({low}) must be positive and at most max_difficulty ({high})"
            )
        params = self.schedule_config
        given = {k for k in params.model_fields_set if getattr(params, k) is not None}
        given = {"total_curriculum_step" if k == "total_step" else k for k in given}
        needed = set(_SCHEDULE_KEYS[str(self.schedule_type)])
        if needed - given:
            raise ValueError(
                f"schedule_type {self.schedule_type} needs schedule_config keys "
                f"{sorted(needed)}; missing {sorted(needed - given)}"
            )
        if given - needed:
            raise ValueError(
                f"schedule_config keys {sorted(given - needed)} are not read by schedule_type "
                f"{self.schedule_type} (it reads {sorted(needed) or 'none: the callback decides'})"
            )
        if self.schedule_type == "fixed_discrete":
            difficulty, max_step = params.difficulty or [], params.max_step or []
            if not max_step or len(difficulty) != len(max_step) + 1:
                raise ValueError(
                    "fixed_discrete needs one more 'difficulty' than 'max_step' (the last "
                    f"difficulty holds after the last max_step); got {len(difficulty)} and "
                    f"{len(max_step)}"
                )
            if sorted(max_step) != max_step:
                raise ValueError(f"fixed_discrete max_step must increase; got {max_step}")


class CurriculumLearningConfig(_CurriculumSchedule):
    """``curriculum_learning`` (DeepSpeed's legacy block): the sequence length of training
    batches grows from ``min_difficulty`` to ``max_difficulty`` tokens. Only
    ``curriculum_type: "seqlen"`` exists (DeepSpeed acted on no other type either)."""

    enabled: Bool = False
    curriculum_type: Literal["seqlen"] = "seqlen"

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> CurriculumLearningConfig:
        if self.enabled:
            self._check_schedule()
        return self


class CurriculumMetricConfig(_CurriculumSchedule):
    """One ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics`` entry.
    The index paths, ``difficulty_type`` and ``clustering_type`` belong to metric-indexed
    sampling (an offline data analyzer orders the samples), which zerotrain refuses by
    key name; a ``seqlen_truncate`` (or ``seqlen``) metric truncates batches."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] = "value"
    clustering_type: Literal["single_cluster", "schedule_based"] = "single_cluster"


class DataCurriculumConfig(Section):
    """``data_efficiency.data_sampling.curriculum_learning``."""

    enabled: Bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``."""

    enabled: Bool = False
    num_epochs: PositiveInt = 1000
    num_workers: NonNegativeInt = 0
    pin_memory: Bool = False
    curriculum_learning: DataCurriculumConfig = Field(default_factory=DataCurriculumConfig)
    # DeepSpeed's token-budget dynamic batching (needs its data analyzer's metrics): refused
    # when enabled (features.py).
    dynamic_batching: LooseSection | None = None


class RandomLTDScheduleParams(Section):
    """``random_ltd_schedule.schedule_config``: the kept-token count grows by
    ``seq_per_step`` over ``require_steps`` steps."""

    require_steps: PositiveInt
    seq_per_step: PositiveInt


class RandomLTDScheduleConfig(Section):
    """``random_ltd_schedule``: tokens each random-LTD layer keeps, from ``min_value`` to
    ``max_value`` (DeepSpeed has ``fixed_linear`` only)."""

    min_value: PositiveInt
    max_value: PositiveInt
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleParams

    @model_validator(mode="after")
    def _ordered(self) -> RandomLTDScheduleConfig:
        if self.min_value > self.max_value:
            raise ValueError(
                f"min_value ({self.min_value}) must be at most max_value ({self.max_value})"
            )
        return self


class LayerTokenLRConfig(Section):
    """``random_ltd.layer_token_lr_schedule`` (DeepSpeed raised NotImplementedError when
    enabled; so does zerotrain)."""

    enabled: Bool = False
    total_layer_tokens: PositiveInt | None = None
    warmup_type: str | None = None
    warmup_layer_tokens: PositiveInt | None = None


class RandomLTDConfig(Section):
    """``data_efficiency.data_routing.random_ltd`` (https://arxiv.org/abs/2211.11586): the
    layers listed in ``random_ltd_layer_id`` (indices into the model's blocks) see a random
    subset of the tokens; the others pass through them unchanged. zerotrain adds
    ``block_types`` (as in ``progressive_layer_drop``)."""

    enabled: Bool = False
    total_layer_num: PositiveInt | None = None
    random_ltd_layer_num: PositiveInt | None = None
    random_ltd_layer_id: list[NonNegativeInt] = Field(default_factory=list)
    model_mask_name: str | None = None
    model_type: Literal["encoder", "decoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    random_ltd_schedule: RandomLTDScheduleConfig | None = None
    layer_token_lr_schedule: LayerTokenLRConfig = Field(default_factory=LayerTokenLRConfig)
    block_types: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        missing = [
            k
            for k in ("total_layer_num", "random_ltd_layer_num", "random_ltd_schedule")
            if getattr(self, k) is None
        ]
        if missing or not self.random_ltd_layer_id:
            raise ValueError(
                f"enabled random_ltd needs {', '.join([*missing, 'random_ltd_layer_id'])}"
            )
        ids = self.random_ltd_layer_id
        if self.random_ltd_layer_num != len(ids) or len(set(ids)) != len(ids):
            raise ValueError(
                f"random_ltd_layer_num ({self.random_ltd_layer_num}) must equal the number of "
                f"distinct layers in random_ltd_layer_id ({ids})"
            )
        if self.total_layer_num is not None and max(ids) >= self.total_layer_num:
            raise ValueError(
                f"random_ltd_layer_id {max(ids)} is not a layer of total_layer_num "
                f"{self.total_layer_num} (ids count from 0)"
            )
        return self


class DataRoutingConfig(Section):
    """``data_efficiency.data_routing``."""

    enabled: Bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


class DataEfficiencyConfig(Section):
    """``data_efficiency``: DeepSpeed's newer home of curriculum learning (``data_sampling``)
    and random-LTD (``data_routing``). A sub-feature acts when it and every section above it
    are enabled. ``seed`` seeds random-LTD's token draws (every rank makes the same)."""

    enabled: Bool = False
    seed: NonNegativeInt = 1234
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)

    def seqlen_curriculum(self) -> tuple[str, CurriculumMetricConfig] | None:
        """The enabled curriculum metric that truncates sequences, if any."""
        sampling = self.data_sampling
        if not (self.enabled and sampling.enabled and sampling.curriculum_learning.enabled):
            return None
        metrics = sampling.curriculum_learning.curriculum_metrics
        for name in SEQLEN_METRICS:
            if name in metrics:
                return name, metrics[name]
        return None

    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD section when it acts."""
        routing = self.data_routing
        active = self.enabled and routing.enabled and routing.random_ltd.enabled
        return routing.random_ltd if active else None


# Metric names whose difficulty is a sequence length the engine truncates batches to
# (Megatron-DeepSpeed's "seqlen_truncate"; "seqlen" as the legacy block calls it).
SEQLEN_METRICS = ("seqlen_truncate", "seqlen")

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleParams",
    "DataEfficiencyConfig",
    "ProgressiveLayerDropConfig",
    "RandomLTDConfig",
]

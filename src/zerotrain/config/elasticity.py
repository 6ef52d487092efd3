"""The ``elasticity`` section: DeepSpeed's keys, defaults and checks (0.19.5, the last release
that has it; 0.19.8 rejects the section). When enabled, the global batch, micro-batch and
accumulation steps come from the elastic plan (``elastic_batch.py``) for the job's
data-parallel world size, so a job restarted on fewer or more ranks keeps its global batch.
A disabled section is checked for unknown keys and value types only.
"""

from __future__ import annotations

from pydantic import model_validator

from zerotrain.config.batch import BatchSizes
from zerotrain.config.elastic_batch import ElasticityError, ElasticOptions, plan_elastic_batch
from zerotrain.config.errors import ConfigError, ConfigProblem
from zerotrain.config.types import Bool, Float, NonNegativeInt, PositiveInt, Section
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


class ElasticityConfig(Section):
    """``elasticity``. ``max_train_batch_size`` and ``micro_batch_sizes`` are required when
    enabled (DeepSpeed's rule); ``min_gpus``/``max_gpus`` bound the data-parallel world
    sizes the plan allows; version 0.2 plans per node (``num_gpus_per_node``,
    ``model_parallel_size``). ``min_time`` is for the scheduler that resizes the job (the
    engine does not read it, nor does DeepSpeed's). ``ignore_non_elastic_batch_info``: let
    the plan override ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
    ``gradient_accumulation_steps`` set in the config (a warning names each), which is
    otherwise an error."""

    enabled: Bool = False
    max_train_batch_size: PositiveInt | None = None
    micro_batch_sizes: list[PositiveInt] | None = None
    min_gpus: PositiveInt = 1
    max_gpus: PositiveInt = 10000
    num_gpus_per_node: PositiveInt = 1
    model_parallel_size: PositiveInt = 1
    min_time: NonNegativeInt = 0
    prefer_larger_batch: Bool = True
    ignore_non_elastic_batch_info: Bool = False
    version: Float = 0.2

    @model_validator(mode="after")
    def _check(self) -> ElasticityConfig:
        if self.version not in (0.1, 0.2):
            raise ValueError(f"version {self.version} is not supported; allowed: 0.1, 0.2")
        if not self.enabled:
            return self
        missing = [
            key
            for key in ("max_train_batch_size", "micro_batch_sizes")
            if getattr(self, key) is None
        ]
        if missing:
            raise ValueError(f"enabled elasticity needs {' and '.join(missing)}")
        if not self.micro_batch_sizes:
            raise ValueError("micro_batch_sizes must list at least one micro-batch size")
        if self.max_gpus < self.min_gpus:
            raise ValueError(
                f"min_gpus ({self.min_gpus}) cannot be greater than max_gpus ({self.max_gpus})"
            )
        return self

    def options(self) -> ElasticOptions:
        """The values the plan reads (the section must be enabled)."""
        assert self.max_train_batch_size is not None
        assert self.micro_batch_sizes is not None
        return ElasticOptions(
            max_train_batch_size=self.max_train_batch_size,
            micro_batch_sizes=tuple(self.micro_batch_sizes),
            min_gpus=self.min_gpus,
            max_gpus=self.max_gpus,
            num_gpus_per_node=self.num_gpus_per_node,
            model_parallel_size=self.model_parallel_size,
            prefer_larger_batch=self.prefer_larger_batch,
            version=self.version,
        )


def elastic_batch_sizes(
    section: ElasticityConfig, given: dict[str, int | None], dp_world_size: int
) -> BatchSizes:
    """The batch sizes of the elastic plan at ``dp_world_size`` (DeepSpeed's rules for
    batch keys also in the config: ``given`` maps their names to their values, None where
    unset).

    Raises:
        ConfigError: batch keys set without ``ignore_non_elastic_batch_info``, no plan, or
            a world size the plan does not allow (with the allowed ones).
    """
    set_keys = {name: value for name, value in given.items() if value is not None}
    if set_keys and not section.ignore_non_elastic_batch_info:
        raise ConfigError(
            [
                ConfigProblem(
                    "elasticity",
                    f"{', '.join(set_keys)} set beside enabled elasticity, which decides the "
                    "batch sizes itself: remove them, or set "
                    "elasticity.ignore_non_elastic_batch_info to true to let the plan override "
                    "them (as in DeepSpeed)",
                )
            ]
        )
    try:
        plan = plan_elastic_batch(section.options(), dp_world_size)
    except ElasticityError as err:
        raise ConfigError([ConfigProblem("elasticity", str(err))]) from err
    assert plan.micro_batch_size is not None
    assert plan.gradient_accumulation_steps is not None
    batch = BatchSizes(
        plan.train_batch_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
        dp_world_size,
    )
    planned = {
        "train_batch_size": batch.train_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
    }
    for name, value in set_keys.items():
        log.warning("elasticity overrides %s: %s -> %s", name, value, planned[name])
    if plan.own_batch:
        log.warning(
            "elasticity (version 0.2): world size %d is not one the plan allows; the batch is "
            "the largest this world size alone can split, so it differs from other world "
            "sizes' and a resize changes it",
            dp_world_size,
        )
    log.info(
        "elasticity: global batch %d = %d micro x %d accumulation x %d ranks; valid "
        "data-parallel world sizes: %s",
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
        dp_world_size,
        list(plan.valid_world_sizes),
    )
    return batch

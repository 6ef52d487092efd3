"""Typed ``params`` for each optimizer and scheduler ``type``.

The valid keys of ``optimizer.params`` depend on ``optimizer.type``, so they are checked in a
second pass, after the type is known. Type names are matched case-insensitively, as
DeepSpeed does (``"Adam"``, ``"adam"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from zerotrain.config.types import (
    Bool,
    Float,
    Int,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Probability,
    Section,
)

Betas = tuple[Probability, Probability]
Ratio = Annotated[Float, Field(ge=0, le=1)]


class AdamParams(Section):
    """Adam. As in DeepSpeed, ``adam_w_mode`` (default true) applies weight decay decoupled
    from the gradient (AdamW); set it to false for L2-regularised Adam."""

    lr: NonNegativeFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: Annotated[Float, Field(gt=0)] = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    bias_correction: Bool = True
    adam_w_mode: Bool = True
    amsgrad: Bool = False
    # DeepSpeed-specific kernel choices; zerotrain picks its own kernel, so these are inert.
    torch_adam: Bool = False
    fused: Bool | None = None


class AdamWParams(AdamParams):
    """AdamW: Adam with decoupled weight decay (``adam_w_mode`` cannot be turned off)."""

    @model_validator(mode="after")
    def _always_decoupled(self) -> AdamWParams:
        if not self.adam_w_mode:
            raise ValueError(
                'AdamW always decouples weight decay; use type "Adam" with '
                '"adam_w_mode": false for L2-regularised Adam'
            )
        return self


class SGDParams(Section):
    """SGD with optional (Nesterov) momentum, as ``torch.optim.SGD``."""

    lr: NonNegativeFloat = 1e-3
    momentum: Annotated[Float, Field(ge=0, le=1)] = 0.0
    dampening: Annotated[Float, Field(ge=0, le=1)] = 0.0
    weight_decay: NonNegativeFloat = 0.0
    nesterov: Bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        return self


class LambParams(Section):
    """LAMB: Adam moments with a per-parameter trust ratio ||w|| / ||update||, clamped to
    ``[min_coeff, max_coeff]``."""

    lr: NonNegativeFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: Annotated[Float, Field(gt=0)] = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    max_coeff: Annotated[Float, Field(gt=0)] = 10.0
    min_coeff: NonNegativeFloat = 0.01

    @model_validator(mode="after")
    def _coeff_range(self) -> LambParams:
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff ({self.min_coeff}) exceeds max_coeff ({self.max_coeff})")
        return self


CommBackend = Literal["nccl", "mpi", "compressed", "hccl"]


class _CompressedParams(Section):
    """What DeepSpeed's 1-bit optimizers share. ``cuda_aware`` and ``comm_backend_name`` are
    accepted (zerotrain runs the compressed all-reduce on its own communicator, on every
    backend, and says so once); ``bias_correction`` and ``eps_inside_sqrt`` are accepted as
    DeepSpeed accepts them, with no effect there either (logged when set). A
    ``max_grad_norm`` here means ``gradient_clipping``, as for every optimizer."""

    lr: NonNegativeFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: Annotated[Float, Field(gt=0)] = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    amsgrad: Bool = False
    cuda_aware: Bool = False
    comm_backend_name: CommBackend = "nccl"

    @model_validator(mode="after")
    def _no_amsgrad(self) -> _CompressedParams:
        if self.amsgrad:
            raise ValueError(
                "amsgrad is not supported by the 1-bit optimizers (as in DeepSpeed): the "
                "variance is frozen after the warm-up, so its running maximum means nothing"
            )
        return self


class OneBitAdamParams(_CompressedParams):
    """1-bit Adam: Adam with full gradient averaging for ``freeze_step`` steps, then the
    variance frozen and the momentum averaged with 1 bit per element."""

    freeze_step: NonNegativeInt = 100000


class ZeroOneAdamParams(_CompressedParams):
    """0/1 Adam: variance updated on a doubling schedule until ``var_freeze_step``, then
    local steps with periodic compressed synchronisation."""

    var_freeze_step: NonNegativeInt = 100000
    var_update_scaler: PositiveInt = 16
    local_step_scaler: PositiveInt = 32678
    local_step_clipper: PositiveInt = 16


class OneBitLambParams(_CompressedParams):
    """1-bit LAMB: LAMB for ``freeze_step`` steps, then the momentum averaged with 1 bit per
    element and trust ratios extrapolated from a fresh variance."""

    freeze_step: NonNegativeInt = 100000
    max_coeff: Annotated[Float, Field(gt=0)] = 10.0
    min_coeff: NonNegativeFloat = 0.01
    coeff_beta: Ratio = 0.9
    factor_max: Annotated[Float, Field(gt=0)] = 4.0
    factor_min: NonNegativeFloat = 0.5
    factor_threshold: NonNegativeFloat = 0.1

    @model_validator(mode="after")
    def _ranges(self) -> OneBitLambParams:
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"min_coeff ({self.min_coeff}) exceeds max_coeff ({self.max_coeff})")
        if self.factor_min > self.factor_max:
            raise ValueError(
                f"factor_min ({self.factor_min}) exceeds factor_max ({self.factor_max})"
            )
        return self


WarmupType = Literal["log", "linear"]
LrOrList = Float | list[Float]


class WarmupLRParams(Section):
    """WarmupLR: lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` (log or linear curve), then stays at ``warmup_max_lr``.
    ``warmup_num_steps: 0`` means no warm-up; ``warmup_max_lr`` defaults to the optimizer's
    lr (as in current DeepSpeed; older versions defaulted to 0.001)."""

    warmup_min_lr: LrOrList = 0.0
    warmup_max_lr: LrOrList | None = None
    warmup_num_steps: NonNegativeInt = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: Int = -1


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    total_num_steps: PositiveInt

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> WarmupDecayLRParams:
        if self.total_num_steps < self.warmup_num_steps:
            raise ValueError(
                f"total_num_steps ({self.total_num_steps}) is smaller than warmup_num_steps "
                f"({self.warmup_num_steps}): the decay would never start"
            )
        return self


class WarmupCosineLRParams(Section):
    """WarmupCosineLR: lr ratio rises from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps``, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps``. Ratios multiply the optimizer's own lr. ``warmup_num_steps: 0``
    means no warm-up."""

    total_num_steps: PositiveInt
    warmup_min_ratio: Ratio = 0.0
    warmup_num_steps: NonNegativeInt = 1000
    cos_min_ratio: Ratio = 1e-4
    warmup_type: WarmupType = "log"
    last_batch_iteration: Int = -1


class OneCycleParams(Section):
    """OneCycle (DeepSpeed's 1Cycle): lr from ``cycle_min_lr`` up to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (default: the
    same), in stairs when the stair counts are above 0; then divided by ``1 + decay_lr_rate *
    t / decay_step_size``. With ``cycle_momentum`` the first beta moves the opposite way
    between ``cycle_max_mom`` and ``cycle_min_mom`` (the second beta becomes 0.99, as in
    DeepSpeed)."""

    cycle_min_lr: Float
    cycle_max_lr: Float
    decay_lr_rate: Float = 0.0
    cycle_first_step_size: PositiveInt = 2000
    cycle_second_step_size: NonNegativeInt | None = None
    cycle_first_stair_count: NonNegativeInt = 0
    cycle_second_stair_count: NonNegativeInt | None = None
    decay_step_size: NonNegativeInt = 0
    cycle_momentum: Bool = True
    cycle_min_mom: Float = 0.8
    cycle_max_mom: Float = 0.9
    decay_mom_rate: Float = 0.0
    last_batch_iteration: Int = -1


class LRRangeTestParams(Section):
    """LRRangeTest: lr = ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * t /
    lr_range_test_step_size)`` (``t / step_size`` floored with ``lr_range_test_staircase``)."""

    lr_range_test_min_lr: LrOrList = 1e-3
    lr_range_test_step_size: PositiveInt = 2000
    lr_range_test_step_rate: Float = 1.0
    lr_range_test_staircase: Bool = False
    last_batch_iteration: Int = -1


OPTIMIZER_PARAMS: Mapping[str, type[Section]] = MappingProxyType(
    {
        "adam": AdamParams,
        "adamw": AdamWParams,
        "sgd": SGDParams,
        "lamb": LambParams,
        "onebitadam": OneBitAdamParams,
        "zerooneadam": ZeroOneAdamParams,
        "onebitlamb": OneBitLambParams,
    }
)
# The optimizers that average with the 1-bit compressed all-reduce.
COMPRESSED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
# Known to DeepSpeed users but not built here yet: named so the error says "not implemented".
OPTIMIZERS_NOT_IMPLEMENTED = (
    "adagrad",
    "lion",
    "muadam",
    "muadamw",
    "musgd",
)
SCHEDULER_PARAMS: Mapping[str, type[Section]] = MappingProxyType(
    {
        "WarmupLR": WarmupLRParams,
        "WarmupDecayLR": WarmupDecayLRParams,
        "WarmupCosineLR": WarmupCosineLRParams,
        "OneCycle": OneCycleParams,
        "LRRangeTest": LRRangeTestParams,
    }
)
SCHEDULERS_NOT_IMPLEMENTED: tuple[str, ...] = ()

# Canonical spellings for messages.
OPTIMIZER_DISPLAY = MappingProxyType(
    {
        "adam": "Adam",
        "adamw": "AdamW",
        "sgd": "SGD",
        "lamb": "Lamb",
        "onebitadam": "OneBitAdam",
        "onebitlamb": "OneBitLamb",
        "zerooneadam": "ZeroOneAdam",
        "adagrad": "Adagrad",
        "lion": "Lion",
        "muadam": "MuAdam",
        "muadamw": "MuAdamW",
        "musgd": "MuSGD",
    }
)


def canonical_optimizer(name: str) -> str:
    """Lower-case key used for optimizer lookups (``"AdamW"`` -> ``"adamw"``)."""
    return name.strip().lower()


def canonical_scheduler(name: str) -> str:
    """Canonical scheduler name, matched case-insensitively (``"warmuplr"`` -> ``"WarmupLR"``)."""
    for known in (*SCHEDULER_PARAMS, *SCHEDULERS_NOT_IMPLEMENTED):
        if known.lower() == name.strip().lower():
            return known
    return name


def params_model(kind: str, type_name: str) -> type[BaseModel] | None:
    """The params model for an optimizer or scheduler type, or None if not implemented/unknown."""
    if kind == "optimizer":
        return OPTIMIZER_PARAMS.get(canonical_optimizer(type_name))
    return SCHEDULER_PARAMS.get(canonical_scheduler(type_name))


def validate_params(model: type[BaseModel], params: dict[str, Any]) -> Any:
    """Validate ``params`` (raises pydantic ``ValidationError`` with locs relative to params)."""
    return model.model_validate(params)

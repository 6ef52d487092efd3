"""Build the optimizer (from the config, or from the user's class) and the schedule."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from zerotrain.config.errors import closest
from zerotrain.config.policies import OptimizerSpec, SchedulerSpec
from zerotrain.optim.adam import Adam
from zerotrain.optim.base import FlatOptimizer
from zerotrain.optim.cyclic_schedules import LRRangeTest, OneCycle
from zerotrain.optim.lamb import Lamb, NormReducer
from zerotrain.optim.schedulers import Schedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from zerotrain.optim.sgd import SGD

# Config keys that choose a kernel in DeepSpeed; zerotrain chooses its own.
_INERT_KEYS = ("torch_adam", "fused")

# torch optimizers whose update of each element depends only on that element's own history,
# so they give the same result on flat shards as on whole parameters.
ELEMENTWISE_TORCH_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)


@dataclass
class FlatGroup:
    """One optimizer param group over flat tensors.

    ``segments[i]`` lists ``(start, end, param_id)`` of every parameter (fragment) inside
    ``tensors[i]``; LAMB needs them, with ``num_ids`` bounding the ids. ``options``
    override the config's hyperparameters for this group.
    """

    tensors: list[torch.Tensor]
    segments: list[tuple[tuple[int, int, int], ...]]
    options: dict[str, Any] = field(default_factory=dict)
    num_ids: int = 0


def hyperparameters(spec: OptimizerSpec) -> dict[str, Any]:
    hyper = {k: v for k, v in spec.params.items() if k not in _INERT_KEYS}
    if spec.name == "adamw":
        hyper["adam_w_mode"] = True
    return hyper


def check_group_options(
    hyperparameters: Sequence[str], options: Sequence[Mapping[str, Any]]
) -> None:
    """Reject a param-group option that looks like a misspelt hyperparameter.

    Other extra keys (a group ``"name"``, say) are kept in the param group, as torch does.
    """
    for i, group in enumerate(options):
        for key in group:
            if key in hyperparameters:
                continue
            guess = closest(key, hyperparameters)
            if guess is not None:
                raise ValueError(
                    f"model_parameters group {i} sets {key!r}, which the optimizer does not "
                    f"have; did you mean {guess!r}?"
                )


def build_optimizer(
    spec: OptimizerSpec, groups: Sequence[FlatGroup], norm_reducer: NormReducer | None = None
) -> FlatOptimizer:
    """The optimizer ``spec`` names, over ``groups`` of flat tensors."""
    hyper = hyperparameters(spec)
    check_group_options(list(hyper), [g.options for g in groups])
    if spec.name == "lamb":
        lamb_groups = [
            {"params": g.tensors, "segments": g.segments, "num_ids": g.num_ids, **g.options}
            for g in groups
        ]
        return Lamb(lamb_groups, norm_reducer=norm_reducer, **hyper)
    param_groups = [{"params": g.tensors, **g.options} for g in groups]
    if spec.name in ("adam", "adamw"):
        return Adam(param_groups, **hyper)
    if spec.name == "sgd":
        return SGD(param_groups, **hyper)
    raise ValueError(f"optimizer '{spec.name}' is not implemented")


def rebuild_over_flat(
    optimizer: torch.optim.Optimizer, groups: Sequence[FlatGroup]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters as ``optimizer``, over flat shards.

    Raises:
        TypeError: the optimizer is not known to be elementwise (its result on a shard of a
            parameter would differ from its result on the whole parameter).
        ValueError: the optimizer has already been stepped (its state cannot be moved).
    """
    cls = type(optimizer)
    if cls not in ELEMENTWISE_TORCH_OPTIMIZERS:
        allowed = ", ".join(c.__name__ for c in ELEMENTWISE_TORCH_OPTIMIZERS)
        raise TypeError(
            f"{cls.__name__} cannot step zerotrain's flat shards (partitioned optimizer "
            "states at ZeRO stages >= 1, or fp32 master weights under bf16/fp16): zerotrain "
            "only knows that these torch optimizers update each element independently (so a "
            f"shard behaves like the whole parameter): {allowed}. Use one of them, or the "
            "config's 'optimizer' section (Adam, AdamW, SGD, Lamb)."
        )
    if any(optimizer.state.values()):
        raise ValueError(
            "the optimizer passed to initialize has already been stepped; its state cannot "
            "be moved onto partitioned shards. Pass a fresh optimizer (or a callable)."
        )
    param_groups = [{"params": g.tensors, **g.options} for g in groups]
    # ``defaults`` can hold entries the constructor does not take (AdamW records
    # decoupled_weight_decay); the param groups above carry every entry anyway.
    accepted = inspect.signature(cls.__init__).parameters
    return cls(param_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


SCHEDULERS: Mapping[str, type[Schedule]] = MappingProxyType(
    {
        "WarmupLR": WarmupLR,
        "WarmupDecayLR": WarmupDecayLR,
        "WarmupCosineLR": WarmupCosineLR,
        "OneCycle": OneCycle,
        "LRRangeTest": LRRangeTest,
    }
)


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> Any:
    """The learning-rate schedule ``spec`` names, driving ``optimizer``."""
    if spec.name not in SCHEDULERS:
        raise ValueError(f"scheduler '{spec.name}' is not implemented")
    return SCHEDULERS[spec.name](optimizer, **spec.params)

"""Pointing ``configure_optimizers``' schedules at the optimizer the engine steps.

When optimizer states are partitioned (or master weights are fp32), ``zerotrain.initialize``
rebuilds the client optimizer over this rank's flat shards: same class, same groups and
hyper-parameters (``initial_lr`` included), a different object. A schedule built in
``configure_optimizers`` still holds the first one, and Lightning steps the schedule, so it
must drive the new optimizer's groups instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def rebind_schedulers(configs: Iterable[LRSchedulerConfig], optimizer: Optimizer) -> None:
    """Make every schedule of ``configs`` (and the schedules a ``SequentialLR`` or
    ``ChainedScheduler`` holds) drive ``optimizer``."""
    found = False
    for config in configs:
        found = _rebind(config.scheduler, optimizer) or found
    if found:
        _track_steps(optimizer)


def _rebind(scheduler: Any, optimizer: Optimizer) -> bool:
    rebound = hasattr(scheduler, "optimizer")
    if rebound:
        scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        rebound = _rebind(inner, optimizer) or rebound
    return rebound


def _track_steps(optimizer: Optimizer) -> None:
    """torch's schedules check that ``optimizer.step()`` ran before their own ``step()``
    through a wrapper they put on the optimizer they are built with; the rebuilt optimizer
    has none, so every schedule would warn. Building a schedule on it installs torch's own
    wrapper; it scales every rate by 1, and the current rates are put back in any case."""
    rates = [group["lr"] for group in optimizer.param_groups]
    LambdaLR(optimizer, lambda _step: 1.0)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate

"""Which engine holds a parameter: a side table keyed by the parameter itself.

``GatheredParameters`` receives bare parameters (DeepSpeed's signature) and must find the
units, and the communicator, that hold them. Instead of attributes hung on ``nn.Parameter``
(DeepSpeed's ``ds_*``), every engine registers its parameters here, keyed by identity and
held weakly: an entry goes away with its parameter, and ``remove`` takes it out when the
engine detaches. This is the one process-wide table of the package.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zerotrain.comm.collectives import Communicator

if TYPE_CHECKING:
    from zerotrain.zero.gather import ParamGatherer


@dataclass(frozen=True)
class Home:
    """Where a parameter lives: the ranks that share it (``comm``) and, at stage 3, the
    gatherer and unit that make it whole.

    The gatherer is held weakly: it holds the parameters, and a value of a weak-key table
    that reaches its own key keeps the entry (and the whole model) alive for good. The
    model's hooks keep the gatherer alive for as long as the model is."""

    comm: Communicator
    gatherer_ref: weakref.ref[ParamGatherer] | None = None
    unit: int = -1

    @classmethod
    def of_unit(cls, comm: Communicator, gatherer: ParamGatherer, unit: int) -> Home:
        return cls(comm, weakref.ref(gatherer), unit)

    @property
    def gatherer(self) -> ParamGatherer | None:
        return None if self.gatherer_ref is None else self.gatherer_ref()


_HOMES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register(params: list[nn.Parameter], home: Home) -> None:
    """Record that ``params`` live in ``home`` (replacing an earlier registration)."""
    for param in params:
        _HOMES[param] = home


def unregister(params: list[nn.Parameter]) -> None:
    """Forget ``params`` (their engine detached)."""
    for param in params:
        _HOMES.pop(param, None)


def home_of(param: nn.Parameter) -> Home | None:
    """Where ``param`` lives, or None if no engine holds it."""
    home = _HOMES.get(param)
    if not isinstance(home, Home) or (home.gatherer_ref is not None and home.gatherer is None):
        return None  # no engine, or its gatherer is gone with the model's hooks
    return home

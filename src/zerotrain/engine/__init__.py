"""The training engine and ``initialize``."""

from zerotrain.engine.accounting import MemoryBreakdown
from zerotrain.engine.data import DistributedDataLoader
from zerotrain.engine.engine import Engine
from zerotrain.engine.initialize import initialize

__all__ = ["DistributedDataLoader", "Engine", "MemoryBreakdown", "initialize"]

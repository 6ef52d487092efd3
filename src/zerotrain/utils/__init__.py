"""Small helpers shared by every layer: logging, invariants, memory probes."""

from zerotrain.utils.repeating_loader import RepeatingLoader
from zerotrain.utils.seed import set_random_seed

__all__ = ["RepeatingLoader", "set_random_seed"]

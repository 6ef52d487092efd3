"""Memory estimation: what one rank holds for a ZeRO configuration, before running it.

Pure arithmetic over parameter shapes (no process group, no allocation)::

    est = estimate_memory(7_000_000_000, world_size=8, stage=3, dtype="bf16")
    print(est.table())
    largest_model_that_fits(80 * 2**30, world_size=8, stage=3, dtype="bf16")

``compare(est, engine.memory_breakdown(), peak_rss)`` lines a prediction up with what the
engine measured. See docs/estimate.md for the formulas.
"""

from zerotrain.estimate.activations import ActivationBytes, gpt_activation_bytes
from zerotrain.estimate.compare import compare
from zerotrain.estimate.core import CATEGORIES, MemoryEstimate, Placement, estimate_memory
from zerotrain.estimate.fit import largest_model_that_fits
from zerotrain.estimate.parse import parse_bytes, parse_count
from zerotrain.estimate.shapes import ModelShape, TransformerShape, shape_of_count, shape_of_module

__all__ = [
    "CATEGORIES",
    "ActivationBytes",
    "MemoryEstimate",
    "ModelShape",
    "Placement",
    "TransformerShape",
    "compare",
    "estimate_memory",
    "gpt_activation_bytes",
    "largest_model_that_fits",
    "parse_bytes",
    "parse_count",
    "shape_of_count",
    "shape_of_module",
]

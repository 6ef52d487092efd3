"""Build a sparsity layout class from the ``sparse_attention`` config section (DeepSpeed's keys).

DeepSpeed read only the keys of the chosen ``mode`` and ignored the rest; here a key no mode
knows is an error (a typo), and a key another mode uses is accepted with a warning that it has
no effect in this mode. Two differences, on purpose: ``mode: "local"`` (DeepSpeed's
``LocalSlidingWindowSparsityConfig``, which its config could not reach) is accepted, and
``attention`` is honoured for ``bigbird`` and ``bslongformer`` (DeepSpeed's config dropped it and
always built them bidirectional).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from zerotrain.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from zerotrain.utils.logging import get_logger

_log = get_logger(__name__)

MODES: Mapping[str, type[SparsityConfig]] = MappingProxyType(
    {
        "dense": DenseSparsityConfig,
        "fixed": FixedSparsityConfig,
        "variable": VariableSparsityConfig,
        "bigbird": BigBirdSparsityConfig,
        "bslongformer": BSLongformerSparsityConfig,
        "local": LocalSlidingWindowSparsityConfig,
    }
)
DEFAULT_MODE = "fixed"

# Keys each mode reads, besides "mode" itself; the class defaults are DeepSpeed's.
_MODE_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "dense": ("block", "different_layout_per_head"),
        "fixed": (
            "block",
            "different_layout_per_head",
            "num_local_blocks",
            "num_global_blocks",
            "attention",
            "horizontal_global_attention",
            "num_different_global_patterns",
        ),
        "variable": (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "local_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
            "horizontal_global_attention",
        ),
        "bigbird": (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "num_sliding_window_blocks",
            "num_global_blocks",
            "attention",
        ),
        "bslongformer": (
            "block",
            "different_layout_per_head",
            "num_sliding_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
        ),
        "local": ("block", "num_sliding_window_blocks", "attention"),
    }
)
# zerotrain's own keys, valid in every mode (see SparseAttentionConfig in config/schema.py).
ZEROTRAIN_KEYS = ("seed", "kernel", "max_seq_length")
ALL_KEYS = tuple(
    sorted({"mode", *ZEROTRAIN_KEYS, *(k for keys in _MODE_KEYS.values() for k in keys)})
)


def sparsity_config_from_dict(section: Mapping[str, Any], num_heads: int) -> SparsityConfig:
    """The layout class a ``sparse_attention`` section describes, for a layer of ``num_heads``.

    Args:
        section: the section as a mapping of DeepSpeed key names (``mode``, ``block``, ...);
            ``None`` values count as unset.
        num_heads: attention heads of the layer the layout is for.

    Returns:
        A :class:`SparsityConfig` subclass instance.

    Raises:
        ValueError: an unknown mode or key, or a value the layout class rejects.
    """
    given = {k: v for k, v in section.items() if v is not None}
    mode = given.pop("mode", DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(
            f"sparse_attention.mode={mode!r}: allowed modes are {', '.join(map(repr, MODES))}"
        )
    unknown = sorted(set(given) - set(ALL_KEYS))
    if unknown:
        raise ValueError(
            f"sparse_attention: unknown key(s) {', '.join(unknown)}; allowed keys are "
            f"{', '.join(ALL_KEYS)}"
        )
    used = _MODE_KEYS[mode]
    unused = sorted(set(given) - set(used) - set(ZEROTRAIN_KEYS))
    if unused:
        _log.warning(
            "sparse_attention: %s ha%s no effect in mode %r (it reads %s)",
            ", ".join(unused),
            "s" if len(unused) == 1 else "ve",
            mode,
            ", ".join(used),
        )
    kwargs = {k: given[k] for k in used if k in given}
    seed = given.get("seed", 0)
    return MODES[mode](num_heads, **kwargs, seed=seed)


def resolve_sparsity(
    sparsity: SparsityConfig | Mapping[str, Any], num_heads: int, kernel: str | None = None
) -> tuple[SparsityConfig, str]:
    """A layout class (kept as given, or built from a section) and the kernel to use:
    ``kernel`` if given, else the section's ``kernel`` key, else ``"auto"``."""
    if isinstance(sparsity, SparsityConfig):
        return sparsity, kernel or "auto"
    config = sparsity_config_from_dict(sparsity, num_heads)
    return config, kernel or str(sparsity.get("kernel") or "auto")

"""What the estimator knows about a model: its parameters' sizes, how ZeRO would split them
into units, and (for transformers) the shape that activations depend on.

Built either from a real module (exact: the same unit planning the engine runs, so padding
is reproduced element for element) or from a parameter count alone (the parameters are then
taken as ``layers`` equal blocks and padding is negligible).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from zerotrain.zero.module_units import plan_module_units

# Without shapes a model is taken as this many equal blocks (a 7B LLaMA has 32 layers): it
# only sizes the stage-3 gathered working set, which is one block plus the prefetch window.
DEFAULT_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class UnitShape:
    """One stage-3 unit: ``numel`` elements, of which the first ``stepped`` are trainable
    (the engine lays out trainable parameters first; frozen ones are gathered, never
    stepped)."""

    numel: int
    stepped: int
    label: str = ""


@dataclass(frozen=True, slots=True)
class TransformerShape:
    """The shape a GPT-like model's activations depend on.

    ``ffn``: width of the MLP's hidden layer (None: ``4 * hidden``).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int | None = None

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width."""
        return self.ffn if self.ffn is not None else 4 * self.hidden


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes of a model's states, independent of the ZeRO configuration.

    Attributes:
        trainable: elements of each trainable parameter, in registration order (stages
            0-2 bucket them in reverse order).
        frozen_numel: elements of parameters without gradients (outside the units at stages
            0-2, inside their block's unit at stage 3).
        buffers: ``(numel, element_size, is_floating)`` of each module buffer.
        blocks: stage-3 units of the repeated blocks, in forward order.
        root: the stage-3 root unit (embeddings, final norm, head), None if empty.
        exact: built from real parameter shapes (else from a count).
        transformer: the shape activations are computed from, when known.
        isolated: stages 0-2: elements of each unit of its own (a pipeline stage's tied
            modules), not in ``trainable``.
    """

    trainable: tuple[int, ...]
    frozen_numel: int
    buffers: tuple[tuple[int, int, bool], ...]
    blocks: tuple[UnitShape, ...]
    root: UnitShape | None
    exact: bool
    transformer: TransformerShape | None = None
    isolated: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        """Every parameter element (shared parameters counted once)."""
        return sum(self.trainable) + sum(self.isolated) + self.frozen_numel

    @property
    def stage3_units(self) -> tuple[UnitShape, ...]:
        """Stage-3 units: the blocks, then the root."""
        return (*self.blocks, *([self.root] if self.root is not None else []))


def shape_of_module(
    module: nn.Module,
    unit_classes: tuple[str, ...] | None = None,
    transformer: TransformerShape | None = None,
    isolate: Sequence[str] = (),
) -> ModelShape:
    """Read ``module``'s parameter shapes (meta tensors are fine: nothing is read).

    Args:
        module: the model, as it would be passed to ``zerotrain.initialize``.
        unit_classes: ``zero_optimization.stage3_unit_classes`` (None: repeated blocks).
        transformer: the activation shape (None: inspected from a ``cfg``/``config``).
        isolate: name prefixes whose parameters form a stage 0-2 unit each (the engine's
            ``isolate``: a pipeline stage's tied modules).

    Raises:
        ValueError: the model has no parameters, or ``unit_classes`` matches nothing.
    """
    params = list(module.named_parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters to estimate")

    def prefix_of(name: str) -> str | None:
        return next((p for p in isolate if name.startswith(p)), None)

    trainable = tuple(p.numel() for n, p in params if p.requires_grad and prefix_of(n) is None)
    isolated = tuple(
        sum(p.numel() for n, p in params if p.requires_grad and prefix_of(n) == prefix)
        for prefix in sorted(isolate)
    )
    frozen = sum(p.numel() for _, p in params if not p.requires_grad)
    buffers = tuple((b.numel(), b.element_size(), b.is_floating_point()) for b in module.buffers())
    blocks, root = plan_module_units(module, unit_classes)

    def unit(members: Any, label: str) -> UnitShape:
        sizes = [(p.numel(), p.requires_grad) for _, p in members]
        return UnitShape(sum(n for n, _ in sizes), sum(n for n, t in sizes if t), label)

    return ModelShape(
        trainable=trainable,
        frozen_numel=frozen,
        buffers=buffers,
        blocks=tuple(unit(b.params, b.label) for b in blocks),
        root=unit(root.params, root.label) if root is not None else None,
        exact=True,
        transformer=transformer or transformer_shape_of(module),
        isolated=tuple(n for n in isolated if n),
    )


def shape_of_count(
    numel: int, layers: int | None = None, transformer: TransformerShape | None = None
) -> ModelShape:
    """A model known only by its parameter count: ``layers`` equal trainable blocks
    (default :data:`DEFAULT_BLOCKS`), no root unit, no buffers.

    Raises:
        ValueError: ``numel`` or ``layers`` below 1.
    """
    if numel < 1:
        raise ValueError(f"the parameter count must be >= 1, got {numel}")
    count = layers if layers is not None else DEFAULT_BLOCKS
    if count < 1:
        raise ValueError(f"layers must be >= 1, got {count}")
    count = min(count, numel)
    base, extra = divmod(numel, count)
    sizes = tuple(base + (1 if i < extra else 0) for i in range(count))
    return ModelShape(
        trainable=sizes,
        frozen_numel=0,
        buffers=(),
        blocks=tuple(UnitShape(n, n, f"block {i}") for i, n in enumerate(sizes)),
        root=None,
        exact=False,
        transformer=transformer,
    )


# Config attribute names of nanoGPT-style configs and of Hugging Face configs.
_NAMES = {
    "layers": ("n_layer", "num_hidden_layers", "n_layers", "num_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model"),
    "heads": ("n_head", "num_attention_heads", "n_heads"),
    "vocab": ("vocab_size",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
}


def transformer_shape_of(module: nn.Module) -> TransformerShape | None:
    """The transformer shape from ``module.cfg`` or ``module.config`` (nanoGPT or Hugging
    Face attribute names), or None when the model has no such config."""
    for attr in ("cfg", "config"):
        cfg = getattr(module, attr, None)
        if cfg is None:
            continue
        found: dict[str, int | None] = {}
        for key, names in _NAMES.items():
            values = [getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)]
            found[key] = values[0] if values else None
        layers, hidden, heads, vocab = (found[k] for k in ("layers", "hidden", "heads", "vocab"))
        if layers and hidden and heads and vocab:
            return TransformerShape(layers, hidden, heads, vocab, found["ffn"])
    return None

"""Finding a model's stack of transformer blocks, which layer drop and random-LTD wrap.

Known: the demo GPT's ``Block``, ``transformers``' ``GPT2Block`` and ``LlamaDecoderLayer``
(pre-LN blocks whose call returns the hidden states, the first argument, plus a residual
update). Others are named by class in the section's ``block_types``.

The features change a block by swapping its class for a same-named subclass with a mixin in
front (:func:`swap_class`), not by wrapping it in another module: parameter names,
``state_dict`` keys and checkpoints stay those of the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

KNOWN_BLOCKS = ("Block", "GPTBlock", "GPT2Block", "LlamaDecoderLayer")


class NoBlockStackError(ValueError):
    """The model has no list of blocks of a known (or named) class."""


def find_block_stack(
    model: nn.Module, block_types: Sequence[str], section: str
) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of transformer blocks in ``model`` and its path.

    A list counts when every entry is a known block class or one named in ``block_types``;
    the longest such list wins.

    Raises:
        NoBlockStackError: no such list (names ``section``.block_types).
        ValueError: two lists of equal length.
    """
    names = set(KNOWN_BLOCKS) | set(block_types)

    def counts(module: nn.Module) -> bool:
        return type(module).__name__ in names

    found: list[tuple[str, nn.ModuleList]] = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and all(map(counts, module))
    ]
    if not found:
        raise NoBlockStackError(
            f"{section}: found no list of transformer blocks in {type(model).__name__} "
            f"(looked for nn.ModuleList entries of class {', '.join(sorted(names))}); name "
            f"the model's pre-LN block class in {section}.block_types"
        )
    found.sort(key=lambda item: len(item[1]), reverse=True)
    if len(found) > 1 and len(found[0][1]) == len(found[1][1]):
        raise ValueError(
            f"{section}: two block lists of {len(found[0][1])} layers ({found[0][0]!r} and "
            f"{found[1][0]!r}); name the one to use's block class in {section}.block_types"
        )
    return found[0]


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _with_mixin(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        # Same name and module, so class-name based choices (stage3_unit_classes,
        # activation_checkpointing.block_types) still match it.
        sub = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
        sub.__qualname__ = cls.__qualname__
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def swap_class(block: nn.Module, mixin: type) -> None:
    """Put ``mixin`` in front of ``block``'s class (idempotent)."""
    if not isinstance(block, mixin):
        block.__class__ = _with_mixin(mixin, type(block))


def restore_class(block: nn.Module, mixin: type) -> None:
    """Undo :func:`swap_class` (the last mixin swapped in)."""
    mro = type(block).__mro__
    if len(mro) > 2 and mro[1] is mixin:
        block.__class__ = mro[2]


def hidden_states_of(args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """A block call's hidden states: its first positional argument or ``hidden_states``."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise TypeError("a wrapped block must get its hidden states first or as hidden_states=")

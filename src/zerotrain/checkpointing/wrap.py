"""``apply(model, block_types)``: checkpoint every block of a model without editing its code.

Each chosen module's class is swapped for a subclass whose ``__call__`` runs the original
call (forward *and* the module's hooks) through ``checkpoint``. Names, state-dict keys,
``isinstance`` checks and the class name stay as they were; hooks, ZeRO stage 3's among
them, run again in the recomputation. ``remove`` swaps the original classes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerotrain.checkpointing.function import checkpoint
from zerotrain.utils.logging import get_logger
from zerotrain.zero.module_units import find_blocks

log = get_logger(__name__)

_ORIGINAL = "_zerotrain_original_class"
_WRAPPED: dict[type[nn.Module], type[nn.Module]] = {}

BlockTypes = str | Sequence[type[nn.Module] | str] | None


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    wrapped = _WRAPPED.get(cls)
    if wrapped is not None:
        return wrapped
    call = cls.__call__

    def checkpointed_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return call(self, *args, **kwargs)
        return checkpoint(call, self, *args, **kwargs)

    wrapped = type(
        cls.__name__,
        (cls,),
        {"__call__": checkpointed_call, _ORIGINAL: cls, "__module__": cls.__module__},
    )
    wrapped.__qualname__ = cls.__qualname__
    _WRAPPED[cls] = wrapped
    return wrapped


def _matching(model: nn.Module, block_types: BlockTypes) -> list[tuple[str, nn.Module]]:
    if block_types is None or block_types == "auto":
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(
                f"no repeated blocks found in {type(model).__name__} (a ModuleList or "
                "Sequential of at least two modules of one class); pass block_types"
            )
        return blocks
    if isinstance(block_types, str):
        raise ValueError(f'block_types must be "auto" or a list of classes, not {block_types!r}')
    types = tuple(t for t in block_types if isinstance(t, type))
    names = {t for t in block_types if isinstance(t, str)}
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, types) or type(child).__name__ in names:
                found.append((path, child))  # the outermost match; nothing inside it
            else:
                visit(f"{path}.", child)

    visit("", model)
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        wanted = sorted({getattr(t, "__name__", str(t)) for t in block_types})
        raise ValueError(
            f"block_types {wanted} match no module of {type(model).__name__}; its module "
            f"classes are: {', '.join(present)}"
        )
    return found


def _stop_key_value_cache(model: nn.Module) -> None:
    """Hugging Face models fill a key/value cache in each layer's forward; recomputing a
    layer would append to it again. Their own gradient checkpointing switches it off."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        log.warning(
            "activation checkpointing: set %s.config.use_cache = False (a layer's key/value "
            "cache would be filled twice: in forward and again in its recomputation)",
            type(model).__name__,
        )


def _hugging_face_checkpointing(model: nn.Module) -> bool:
    # The newer name first: reading the older one warns that it is deprecated.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


def apply(model: nn.Module, block_types: BlockTypes = "auto") -> list[str]:
    """Checkpoint every block of ``model``, in place.

    Args:
        model: any ``nn.Module`` (Hugging Face models included).
        block_types: "auto" (or None) for the repeated blocks (the children of a
            ``ModuleList``/``Sequential`` that are all of one class, like the layers of a
            transformer), or classes / class names whose outermost instances are
            checkpointed.

    Returns:
        The checkpointed modules' names.

    Raises:
        ValueError: nothing matches, or the model's own gradient checkpointing is on.
    """
    if _hugging_face_checkpointing(model):
        raise ValueError(
            f"{type(model).__name__} already checkpoints its layers (Hugging Face "
            "gradient_checkpointing_enable()); use that or zerotrain.checkpointing.apply, "
            "not both"
        )
    blocks = _matching(model, block_types)
    for _, module in blocks:
        cls = type(module)
        if getattr(cls, _ORIGINAL, None) is None:
            module.__class__ = _checkpointed_class(cls)
    _stop_key_value_cache(model)
    names = [name for name, _ in blocks]
    log.info("activation checkpointing: %d block(s), %s ... %s", len(names), names[0], names[-1])
    return names


def remove(model: nn.Module) -> int:
    """Undo ``apply``: the modules get their own classes back. Returns how many."""
    count = 0
    for module in model.modules():
        original = type(module).__dict__.get(_ORIGINAL)
        if original is not None:
            module.__class__ = original
            count += 1
    return count


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply`` made this module's calls checkpointed."""
    return type(module).__dict__.get(_ORIGINAL) is not None

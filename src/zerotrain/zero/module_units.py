"""Choosing stage-3 units: which modules' parameters are gathered and released together.

By default the repeated blocks of the model are units: the children of every ``ModuleList``
or ``Sequential`` whose children (at least two) are all of one type, like the layers of a
transformer. Everything else (embeddings, final norm, output head, loose parameters) forms
the root unit, which is gathered for the whole forward and backward pass. A list of module
classes overrides the choice: every outermost module of those classes is a unit.

A model may choose its units itself with a method ``zero_unit_modules()`` returning
``(path, module)`` pairs (a pipeline stage names each of its layers and each tied module);
``stage3_unit_classes`` still takes precedence.

A parameter belongs to a block only if every name it has lies inside that block; a
parameter shared with anything outside (an embedding tied to the output head, a table
passed into every layer) goes to the root unit, which is gathered whenever any block runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

ROOT_LABEL = "<root>"


@dataclass(frozen=True)
class ModuleUnit:
    """A module whose parameters form one stage-3 unit.

    ``name`` is the module's path in the model ("" for the root); ``params`` lists the
    unit's parameters by their first name, in registration order.
    """

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]

    @property
    def label(self) -> str:
        """How messages name the unit."""
        return self.name or ROOT_LABEL

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters."""
        return sum(p.numel() for _, p in self.params)


def _runs_forward(module: nn.Module) -> bool:
    """Whether the module is called (ModuleList and ModuleDict are containers only)."""
    return not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _repeated_children(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return None
    children = list(module.named_children())
    # Compared by name: a block whose class was swapped for a same-named subclass (random-LTD
    # on some layers, checkpointing, layer drop) is still one of the repeated blocks.
    kinds = {(type(c).__module__, type(c).__qualname__) for _, c in children}
    if len(children) < 2 or len(kinds) != 1:
        return None
    if not _runs_forward(children[0][1]) or not any(True for _ in children[0][1].parameters()):
        return None  # a list of containers: look inside them instead
    return children


def find_blocks(
    model: nn.Module, classes: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The modules that become units, outermost first in registration order.

    Args:
        model: the model.
        classes: class names (``type(m).__name__``) whose outermost instances are units;
            None picks the repeated blocks.
    """
    found: list[tuple[str, nn.Module]] = []

    def visit_classes(prefix: str, module: nn.Module, wanted: Sequence[str]) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if type(child).__name__ in wanted and _runs_forward(child):
                found.append((path, child))
            else:
                visit_classes(f"{path}.", child, wanted)

    if classes is not None:
        visit_classes("", model, classes)
        return found

    def visit_default(prefix: str, module: nn.Module) -> None:
        repeated = _repeated_children(module)
        if repeated is not None:
            found.extend((f"{prefix}{name}", child) for name, child in repeated)
            return
        for name, child in module.named_children():
            visit_default(f"{prefix}{name}.", child)

    visit_default("", model)
    return found


def plan_module_units(
    model: nn.Module, classes: Sequence[str] | None = None
) -> tuple[list[ModuleUnit], ModuleUnit | None]:
    """Blocks (in registration order) and the root unit (None if nothing is left for it).

    Raises:
        ValueError: ``classes`` names no module of the model.
    """
    if classes is not None and type(model).__name__ in classes:
        raise ValueError(
            f"zero_optimization.stage3_unit_classes names the model's own class "
            f"'{type(model).__name__}': the whole model is the root unit already; name the "
            "classes of its repeated blocks"
        )
    declared = getattr(model, "zero_unit_modules", None)
    if classes is None and callable(declared):
        blocks = list(declared())
    else:
        blocks = find_blocks(model, classes)
    if classes is not None and not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"zero_optimization.stage3_unit_classes={list(classes)} matches no module of the "
            f"model; its module classes are: {', '.join(present)}"
        )
    names: dict[int, list[str]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        first.setdefault(id(param), (name, param))

    home: dict[int, int] = {}  # parameter id -> block index
    for b, (path, _) in enumerate(blocks):
        prefix = f"{path}."
        for pid, all_names in names.items():
            if all(n.startswith(prefix) for n in all_names):
                home[pid] = b

    units = []
    for b, (path, module) in enumerate(blocks):
        params = tuple(first[pid] for pid in first if home.get(pid) == b)
        if params:
            units.append(ModuleUnit(path, module, params))
    rest = tuple(first[pid] for pid in first if pid not in home)
    root = ModuleUnit("", model, rest) if rest else None
    return units, root

"""Applying Ulysses to a model without rewriting it.

A model names its attention cores (the modules that take q, k, v and return the context)
in a plan ``{module-name glob: layout}``, where the layout says where heads and sequence
are in the core's inputs: ``"bhsd"`` (batch, heads, sequence, head dim: SDPA's and
transformers'), ``"bshd"`` (flash-attention's) or ``"sbhd"`` (Megatron's). Any module may
carry one as ``_sp_plan``, relative to itself: the demo GPT's blocks carry
``{"attn.core": "bhsd"}``, so the GPT and a pipeline of its blocks both find it. Each
matched core's ``forward`` is routed through :class:`DistributedAttention`; the module
itself stays where it was, so parameter names and checkpoints do not change.
``transformers`` models need no plan (``zerotrain.parallel.sequence.hf``).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence.attention import DistributedAttention

# layout -> (heads dimension, sequence dimension) of q, k, v and the context
LAYOUTS = {"bhsd": (1, 2), "bshd": (2, 1), "sbhd": (2, 0)}


def model_sp_plan(model: nn.Module) -> dict[str, str] | None:
    """The Ulysses plan of ``model``: its own ``_sp_plan`` and those of its submodules, each
    glob prefixed with where the submodule sits (a block class can carry the plan of its
    attention, so the model and a pipeline of its blocks both find it); a submodule inside
    one that has a plan adds nothing. None when no module has one."""
    plan: dict[str, str] = {}
    planned: list[str] = []
    for name, module in model.named_modules():
        own = getattr(module, "_sp_plan", None)
        if not own or any(name.startswith(p) for p in planned):
            continue
        planned.append(f"{name}." if name else "")
        plan.update({f"{name}.{glob}" if name else glob: v for glob, v in own.items()})
    return plan or None


def apply_ulysses(model: nn.Module, comm: Communicator, plan: dict[str, str]) -> list[str]:
    """Route every attention core ``plan`` names through the sequence group; returns their
    names.

    Raises:
        ValueError: an unknown layout, or a plan that matches no module.
    """
    for pattern, layout in plan.items():
        if layout not in LAYOUTS:
            raise ValueError(
                f"Ulysses plan entry {pattern!r}: unknown layout {layout!r}; allowed: "
                f"{sorted(LAYOUTS)}"
            )
    applied = []
    for name, module in model.named_modules():
        found = next((v for p, v in plan.items() if fnmatch.fnmatchcase(name, p)), None)
        if found is None:
            continue
        heads, sequence = LAYOUTS[found]
        routed = DistributedAttention(module.forward, comm, scatter_idx=heads, gather_idx=sequence)
        # An instance attribute shadows the class's forward; not registered as a child,
        # so the module's parameters keep their names.
        object.__setattr__(module, "forward", routed)
        applied.append(name)
    if not applied:
        raise ValueError(
            f"the Ulysses plan {plan} matches no module of {type(model).__name__}; the "
            "patterns are globs over module names (model.named_modules())"
        )
    return applied

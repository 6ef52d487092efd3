"""Layer specifications: a layer described by its class and arguments, built only where it runs.

A pipeline stage must not allocate the layers of the other stages, yet every stage has to agree
on the partition, which depends on every layer's size. A spec solves both: it is built for real
on the stage that runs it and on the meta device (shapes only, no memory) everywhere else.
DeepSpeed's ``LayerSpec`` / ``TiedLayerSpec`` names and arguments, so its layer lists run here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# (module, x) -> output; typed loosely so a function taking a subclass of nn.Module fits.
ForwardFn = Callable[..., Any]


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, to be built later by the stage that owns it.

    Args:
        typename: an ``nn.Module`` subclass.
        *module_args, **module_kwargs: its constructor's arguments, kept by reference (they
            are not copied, so every build sees the same objects).

    Raises:
        TypeError: ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}; wrap "
                "plain functions by putting them in the layer list directly (they are called "
                "as layers without a spec)"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, device: torch.device | str | None = None) -> nn.Module:
        """A new module from the spec.

        Args:
            device: where its parameters and buffers are created (``"meta"``: shapes only,
                no memory and no initialisation cost); None: torch's current default device.
        """
        if device is None:
            return self.typename(*self.module_args, **self.module_kwargs)
        with torch.device(device):
            return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})".replace(
            ", )", ")"
        )


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every occurrence with the same ``key``.

    The module is built once per stage that holds an occurrence (an input embedding on the
    first stage and the output head reusing its weight on the last, say); the engine keeps
    every parameter of those copies equal by summing their gradients after each backward
    (DeepSpeed sums only ``tied_weight_attr``; the others would drift apart between copies).

    Args:
        key: the name the occurrences share.
        typename, *module_args, **module_kwargs: as for :class:`LayerSpec`.
        forward_fn: ``forward_fn(module, x)`` runs this occurrence (None: ``module(x)``), so
            one module can serve as an embedding in one place and a projection in another.
        tied_weight_attr: the attribute name(s) of the tied parameters on the module, dotted
            for nested ones (``"token.weight"``); a string or a sequence of strings.

    Raises:
        TypeError: a ``typename`` that is not an ``nn.Module`` subclass, an empty or non-string
            key, or ``tied_weight_attr`` that is not a string or strings.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: ForwardFn | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise TypeError(
                f"TiedLayerSpec: key must be a non-empty string without '.', got {key!r}"
            )
        attrs = (
            (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        )
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise TypeError(
                "TiedLayerSpec: tied_weight_attr must be an attribute name or a list of them "
                f"(e.g. 'weight' or ['token.weight']), got {tied_weight_attr!r}"
            )
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec: forward_fn must be callable, got {forward_fn!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr: tuple[str, ...] = attrs

    def __repr__(self) -> str:
        base = super().__repr__().removeprefix(f"{type(self).__name__}(")
        return f"{type(self).__name__}({self.key!r}, {base}"

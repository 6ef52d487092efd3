"""One contiguous storage for a group of parameters, with each parameter a view into it.

Packing parameters (and their gradients) into one buffer is what lets a single collective
carry a whole bucket and a single fused kernel update it. The parameters stay the same
``nn.Parameter`` objects the user holds; only their storage moves (``param.data = view``),
so references in user code and user optimizers stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerotrain.shard.layout import FlatLayout
from zerotrain.utils.invariant import invariant


class FlatParamBuffer:
    """Parameters of one unit packed into ``data``; gradients packed into ``grad``.

    Args:
        layout: where each parameter goes (``layout.params[i]`` describes ``params[i]``).
        params: the parameters, all of one dtype and on one device.
    """

    def __init__(self, layout: FlatLayout, params: Sequence[nn.Parameter]) -> None:
        invariant(len(layout.params) == len(params), "layout and params differ in length")
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                "parameters of one buffer must share dtype and device, got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        self.layout = layout
        self.params = tuple(params)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.data = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for spec, param in zip(layout.params, params, strict=True):
                invariant(tuple(param.shape) == spec.shape, f"{spec.fqn}: shape changed")
                view = self.data[spec.start : spec.end].view(spec.shape)
                view.copy_(param.detach())
                param.data = view
        self.grad: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter storage (padding included)."""
        return self.data.numel() * self.data.element_size()

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the gradient storage, 0 when not allocated."""
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()

    def grad_view(self, index: int) -> torch.Tensor:
        """The slice of ``grad`` that holds ``params[index]``'s gradient, shaped like it."""
        invariant(self.grad is not None, "gradient storage is not allocated")
        spec = self.layout.params[index]
        return self.grad[spec.start : spec.end].view(spec.shape)  # type: ignore[index]

    def allocate_grads(self) -> None:
        """Create zeroed gradient storage and point every ``param.grad`` into it.

        The flat tensor ``data`` gets ``grad`` as its ``.grad`` too, so an optimizer can step
        the whole buffer as one tensor.
        """
        self.grad = torch.zeros_like(self.data)
        self.data.grad = self.grad
        for i, param in enumerate(self.params):
            param.grad = self.grad_view(i)

    def adopt_grad(self, index: int) -> None:
        """Make ``params[index].grad`` a view of ``grad`` again.

        If something replaced it (``model.zero_grad()`` sets it to None, after which autograd
        allocates a fresh tensor), the fresh gradient is added into the buffer first so no
        contribution is lost.
        """
        param = self.params[index]
        view = self.grad_view(index)
        current = param.grad
        if current is not None and current.data_ptr() == view.data_ptr():
            return
        if current is not None:
            view.add_(current)
        param.grad = view

    def zero_grads(self) -> None:
        """Zero the gradient storage in place (views stay valid)."""
        if self.grad is not None:
            self.grad.zero_()

"""One contiguous storage for a group of parameters, with each parameter a view into it.

Packing parameters into one buffer is what lets a single collective carry a whole unit and a
single fused kernel update it. The parameters stay the same ``nn.Parameter`` objects the
user holds; only their storage moves (``param.data = view``), so references in user code and
user optimizers stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.storage import ResidentSlot, SlotStorage, StatePlacement
from zerotrain.utils.invariant import invariant


class FlatParamBuffer:
    """Parameters of one unit packed into ``data`` (padding at the end is zero).

    Args:
        layout: where each parameter goes (``layout.params[i]`` describes ``params[i]``).
        params: the parameters, all on one device.
        dtype: of the buffer (the parameters are cast to it); default: the parameters' own,
            which must then be one dtype.
    """

    def __init__(
        self,
        layout: FlatLayout,
        params: Sequence[nn.Parameter],
        dtype: torch.dtype | None = None,
    ) -> None:
        invariant(len(layout.params) == len(params), "layout and params differ in length")
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if (dtype is None and len(dtypes) != 1) or len(devices) != 1:
            raise ValueError(
                "parameters of one buffer must share dtype and device, got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        self.layout = layout
        self.params = tuple(params)
        self.dtype = dtype or params[0].dtype
        self.device = params[0].device
        self.data = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, param in enumerate(params):
                invariant(tuple(param.shape) == layout.params[i].shape, "shape changed")
                view = self.view(self.data, i)
                view.copy_(param.detach())
                param.data = view
        # Stages 0-2 keep whole parameters in memory: offload never moves them.
        self.slot: SlotStorage = ResidentSlot(self.data)

    def place(self, placement: StatePlacement, unit_numel: int) -> None:
        """Nothing to place: whole parameters stay in memory (see ``PartitionedParams``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the parameter storage (padding included)."""
        return self.data.numel() * self.data.element_size()

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The part of a buffer-sized tensor ``flat`` that belongs to ``params[index]``."""
        spec = self.layout.params[index]
        return flat[spec.start : spec.end].view(spec.shape)

    def owned_slice(self, a: int, b: int) -> torch.Tensor:
        """Parameter values of ``[a, b)`` of the buffer."""
        return self.data[a:b]

    def readopt(self) -> bool:
        """Point parameters whose ``.data`` was replaced (``param.data = t``) back into the
        buffer, taking their new values; True if any was.

        Runs before every optimizer step, so the check is host arithmetic on addresses: a
        parameter still in place starts where its part of the buffer does. Building each
        part's view and reading ``param.data`` cost three dispatched operations per
        parameter every step (about 880 on a 293-parameter model; issue 43)."""
        base, itemsize = self.data.data_ptr(), self.data.element_size()
        replaced = False
        with torch.no_grad():
            for i, param in enumerate(self.params):
                spec = self.layout.params[i]
                if spec.end > spec.start and param.data_ptr() == base + spec.start * itemsize:
                    continue  # in place (empty parameters take the slow look below)
                view = self.view(self.data, i)
                if param.data.data_ptr() != view.data_ptr():
                    view.copy_(param.data)
                    param.data = view
                    replaced = True
        return replaced

    def release(self) -> None:
        """Give every parameter its own storage again (the buffer is no longer used)."""
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()
                param.grad = None

"""The bytes of a tensor as a ``memoryview``, for file I/O without copies."""

from __future__ import annotations

import ctypes

import torch


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy.

    Made from the data pointer rather than through ``.numpy()``, which marks the storage
    as not resizable for good (swapped-out tensors free and regrow theirs). The caller
    keeps the tensor alive while the view is in use.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")

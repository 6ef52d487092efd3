"""The dtypes a checkpoint manifest names: the config's short names (``fp32``, ``bf16``) for
floating point, torch's own (``int64``, ``bool``) for everything else (buffers such as
BatchNorm's ``num_batches_tracked``)."""

from __future__ import annotations

import torch

from zerotrain.checkpoint.errors import IncompatibleCheckpointError
from zerotrain.config.policies import DTYPE_BY_NAME


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype ``name`` stands for.

    Raises:
        IncompatibleCheckpointError: a name that is no torch dtype.
    """
    if name in DTYPE_BY_NAME:
        return DTYPE_BY_NAME[name]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise IncompatibleCheckpointError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype

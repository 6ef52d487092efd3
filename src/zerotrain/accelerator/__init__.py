"""DeepSpeed's accelerator API (``deepspeed.accelerator``) for the CPU and CUDA.

``from zerotrain.accelerator import get_accelerator`` (or, with ``import zerotrain as
deepspeed``, ``deepspeed.accelerator.get_accelerator()``) returns the accelerator of the
device zerotrain computes on; docs/migrating_from_deepspeed.md lists where its answers
differ from DeepSpeed's.
"""

from zerotrain.accelerator.base import Accelerator
from zerotrain.accelerator.cpu import CpuAccelerator
from zerotrain.accelerator.cuda import CudaAccelerator
from zerotrain.accelerator.select import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

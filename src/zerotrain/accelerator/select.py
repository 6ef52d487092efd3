"""Which accelerator ``get_accelerator()`` returns: the device zerotrain computes on.

zerotrain places tensors where ``comm.env.select_device`` says (CUDA when available,
``ZEROTRAIN_DEVICE=cpu|cuda`` to choose). DeepSpeed scripts may also set ``DS_ACCELERATOR``;
zerotrain takes ``cpu`` and ``cuda`` there, and refuses a value that would leave the
accelerator and the engine on different devices rather than let them drift apart.
"""

from __future__ import annotations

import os
import threading

import torch

from zerotrain.accelerator.base import Accelerator
from zerotrain.accelerator.cpu import CpuAccelerator
from zerotrain.accelerator.cuda import CudaAccelerator
from zerotrain.comm.env import select_device
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

SUPPORTED_ACCELERATORS = ("cpu", "cuda")


def accelerator_name() -> str:
    """``"cpu"`` or ``"cuda"``: zerotrain's device, checked against ``DS_ACCELERATOR``.

    Raises:
        ValueError: ``DS_ACCELERATOR`` (or ``ZEROTRAIN_DEVICE``) names another accelerator,
            or the two variables disagree with each other or with the device zerotrain picks.
        RuntimeError: CUDA is asked for, but torch sees no CUDA device.
    """
    requested = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if requested and requested not in SUPPORTED_ACCELERATORS:
        raise ValueError(
            f"DS_ACCELERATOR must be one of {', '.join(map(repr, SUPPORTED_ACCELERATORS))} "
            f"(zerotrain runs on no other accelerator), got {os.environ['DS_ACCELERATOR']!r}"
        )
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "DS_ACCELERATOR=cuda, but torch sees no CUDA device on this machine (torch "
            f"{torch.__version__}); unset it or set DS_ACCELERATOR=cpu"
        )
    chosen = select_device(0)[0].type
    if requested and requested != chosen:
        if os.environ.get("ZEROTRAIN_DEVICE", "").strip():
            why = f"ZEROTRAIN_DEVICE={os.environ['ZEROTRAIN_DEVICE'].strip()}"
        else:
            why = "ZEROTRAIN_DEVICE is unset and CUDA is available"
        raise ValueError(
            f"DS_ACCELERATOR={requested}, but zerotrain computes on {chosen} ({why}); set "
            f"ZEROTRAIN_DEVICE={requested} as well, so that tensors and the accelerator agree"
        )
    return chosen


def make_accelerator(name: str) -> Accelerator:
    """A new accelerator for ``name`` (``"cpu"`` or ``"cuda"``).

    Raises:
        ValueError: any other name.
    """
    if name == "cpu":
        return CpuAccelerator()
    if name == "cuda":
        return CudaAccelerator()
    raise ValueError(f"accelerator must be one of {SUPPORTED_ACCELERATORS}, got {name!r}")


class _Current:
    """The accelerator ``get_accelerator()`` hands out. Process-wide on purpose, an exception
    to "no module-level mutable state": DeepSpeed's API is a process global that scripts and
    libraries call from anywhere, so there is exactly one, replaced only by
    ``set_accelerator``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accelerator: Accelerator | None = None


_CURRENT = _Current()


def get_accelerator() -> Accelerator:
    """The accelerator for the device zerotrain computes on, created on the first call.

    Returns:
        The same object on every call until :func:`set_accelerator` replaces it.

    Raises:
        ValueError, RuntimeError: see :func:`accelerator_name` (on the first call only).
    """
    with _CURRENT.lock:
        if _CURRENT.accelerator is None:
            name = accelerator_name()
            _CURRENT.accelerator = make_accelerator(name)
            log.debug("accelerator: %s", name)
        return _CURRENT.accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    """Make ``accelerator`` the one :func:`get_accelerator` returns from now on.

    Raises:
        TypeError: ``accelerator`` is not a :class:`zerotrain.accelerator.Accelerator`.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            "set_accelerator needs a zerotrain.accelerator.Accelerator (CpuAccelerator, "
            f"CudaAccelerator or a subclass), got {type(accelerator).__name__}"
        )
    with _CURRENT.lock:
        _CURRENT.accelerator = accelerator
    log.debug("accelerator set to %s", accelerator.name)


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator's device is one zerotrain runs on (cpu or cuda)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS

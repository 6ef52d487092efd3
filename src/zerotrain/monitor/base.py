"""The monitor interface and the check for a backend's optional package."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol, runtime_checkable

from zerotrain.monitor.policy import MonitorKind

Event = tuple[str, float, int]
"""``(tag, value, step)``: one point of a scalar series; see :mod:`zerotrain.monitor.tags`."""


@runtime_checkable
class Monitor(Protocol):
    """A sink for scalar series. Backends and the :class:`Monitors` fan-out implement it."""

    def write(self, events: Sequence[Event]) -> None:
        """Record ``events``, ``(tag, value, step)`` triples.

        The file backends flush before returning, so a crash later in the step loses nothing
        already written; wandb hands the rows to its own service process, which writes them.
        """
        ...

    def close(self) -> None:
        """Flush and release files or runs. Calling it again does nothing."""
        ...


def _missing_message(kind: MonitorKind, module: str) -> str:
    package = kind.package or module
    return (
        f"'{kind.value}' is enabled but the module '{module}' cannot be imported: "
        f"pip install {package}  (or: pip install 'zerotrain[{package}]'), "
        f"or disable '{kind.value}' in the config"
    )


def check_dependency(kind: MonitorKind, module: str | None = None) -> None:
    """Raise if the package ``kind`` needs is not installed, without importing it.

    Every rank calls this at start-up, so a missing package stops all ranks together rather
    than only rank 0 (the others would wait in their next collective until it timed out).

    Args:
        kind: the backend.
        module: the module to look for; None means the backend's own package. Tests pass a
            name that does not exist to see the error.

    Raises:
        ImportError: the module cannot be found; the message says what to install.
    """
    name = module or kind.package
    if name is None:
        return
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # find_spec raises for a parent package that is missing or for a broken entry.
        found = False
    if not found:
        raise ImportError(_missing_message(kind, name))


def import_dependency(kind: MonitorKind, module: str | None = None) -> ModuleType:
    """Import and return the package ``kind`` needs (see :func:`check_dependency`).

    Raises:
        ImportError: the module cannot be imported; the message says what to install.
        ValueError: ``kind`` needs no package and no ``module`` was given.
    """
    name = module or kind.package
    if name is None:
        raise ValueError(f"'{kind.value}' needs no optional package")
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(_missing_message(kind, name)) from err


def checked_events(events: Sequence[Event]) -> list[Event]:
    """Return ``events`` as ``(str, float, int)`` tuples, in order.

    Values are converted with ``float()`` so a 0-d tensor or numpy scalar is accepted; NaN and
    inf pass through, because a diverging loss is exactly what a monitor should show.

    Raises:
        TypeError: an event is not a ``(tag, value, step)`` triple of those types.
        ValueError: a tag is empty or a step is negative.
    """
    out: list[Event] = []
    for i, event in enumerate(events):
        if not isinstance(event, tuple) or len(event) != 3:
            raise TypeError(f"monitor event {i}: expected (tag, value, step), got {event!r}")
        tag, value, step = event
        if not isinstance(tag, str):
            raise TypeError(f"monitor event {i}: tag must be a str, got {tag!r}")
        if not tag:
            raise ValueError(f"monitor event {i}: tag must not be empty")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"monitor event {i} ({tag}): step must be an int, got {step!r}")
        if step < 0:
            raise ValueError(f"monitor event {i} ({tag}): step must be >= 0, got {step}")
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"monitor event {i} ({tag}): value {value!r} is not a number") from err
        out.append((tag, number, step))
    return out

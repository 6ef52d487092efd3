"""Internal consistency checks that survive ``python -O`` (unlike ``assert``)."""

from __future__ import annotations


class InvariantError(RuntimeError):
    """A zerotrain bug or a misuse of internals: state that should be impossible."""


def invariant(condition: bool, message: str) -> None:
    """Raise :class:`InvariantError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvariantError(message)

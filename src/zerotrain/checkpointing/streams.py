"""Random streams besides torch's own that a recomputed region must replay.

``torch.utils.checkpoint`` records and restores the CPU and device generators, so dropout
drawn from them recomputes the same masks. A stream kept elsewhere (tensor parallelism's
per-rank stream, switched in only inside split regions) would instead move on, and the
recomputation would draw new masks: gradients silently wrong. Such a stream registers here;
each checkpointed region records its state when the region's forward starts and sets it
back around the recomputation.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Protocol


class RandomStream(Protocol):
    """A stream whose state can be read and put back."""

    def get_state(self) -> Any:
        """The state now."""
        ...

    def set_state(self, state: Any) -> None:
        """Continue from ``state``."""
        ...


_STREAMS: weakref.WeakSet[Any] = weakref.WeakSet()


def register_random_stream(stream: RandomStream) -> None:
    """Replay ``stream`` in checkpointed regions (held weakly: it unregisters when freed)."""
    _STREAMS.add(stream)


def record_streams() -> list[tuple[RandomStream, Any]]:
    """Every registered stream with its state now (a region's forward is starting)."""
    return [(stream, stream.get_state()) for stream in list(_STREAMS)]


@contextlib.contextmanager
def replayed(recorded: list[tuple[RandomStream, Any]]) -> Iterator[None]:
    """Run the recomputation from the recorded states, then put the streams back where
    training had taken them."""
    current = [(stream, stream.get_state()) for stream, _ in recorded]
    for stream, state in recorded:
        stream.set_state(state)
    try:
        yield
    finally:
        for stream, state in current:
            stream.set_state(state)

"""What every issued communication returns: a :class:`Handle` with an explicit ``wait()``,
and the :class:`CollectiveError` a failed or timed-out one raises.

Shared by the collectives (``collectives.py``) and point-to-point exchanges (``p2p.py``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from zerotrain.comm import liveness, shm

#: What most likely went wrong when a collective failed without a clearer cause.
COLLECTIVE_HINT = (
    "Another rank probably exited, or the ranks issued different collectives (different "
    "code paths or models); see the other ranks' output."
)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the collective."""


class Waitable(Protocol):
    """What a :class:`Handle` waits on: a backend's ``dist.Work``, or a message of the
    shared-memory mailbox (``shm_mailbox.MailboxMessage``)."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: datetime.timedelta = ...) -> bool: ...


class Handle:
    """An issued collective (possibly several backend operations). ``wait()`` blocks until
    all of them finished, then runs ``on_done``.

    Args:
        work: the backend's pending operations (None or empty: already complete).
        describe: the text naming this rank and the operation, for error messages.
        on_done: run once, after every operation finished.
        timeout: how long each wait lasts (None: the backend's own watchdog).
        hint: what most likely went wrong, appended to failure messages.
    """

    def __init__(
        self,
        work: dist.Work | Sequence[Waitable] | None,
        describe: Callable[[], str],
        on_done: Callable[[], None] | None = None,
        timeout: datetime.timedelta | None = None,
        hint: str = COLLECTIVE_HINT,
        explain: Callable[[], str] | None = None,
    ) -> None:
        if work is None:
            work = []
        self._explain = explain
        self._works: list[Waitable] = [work] if isinstance(work, dist.Work) else list(work)
        self._describe = describe
        self._on_done = on_done
        self._timeout = timeout
        self._hint = hint
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once ``wait()`` has returned."""
        return self._finished

    def done(self) -> bool:
        """Whether every operation completed (never blocks; an operation that failed
        counts as done, and ``wait()`` raises its error)."""
        return self._finished or all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        """Block until the collective completed (idempotent).

        Raises:
            CollectiveError: an operation failed or did not finish within the timeout.
        """
        if self._finished:
            return
        try:
            with liveness.waiting():
                for work in self._works:
                    if self._timeout is None:
                        work.wait()
                    else:
                        work.wait(self._timeout)
        except Exception as exc:
            message = failure_message(self._describe(), exc, self._hint, self._explain)
            raise CollectiveError(message) from exc
        self._finished = True
        # Drop what the operations and the callback held (buffers of a combined
        # collective): a finished handle kept for later waits must not keep them alive.
        self._works = []
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()


def describe_tensor(tensor: torch.Tensor) -> str:
    """``(4, 2) float32, 32 bytes``: shape, dtype and size, for signatures and errors."""
    nbytes = tensor.numel() * tensor.element_size()
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}, {nbytes} bytes"


def signature(op: str, purpose: str, payload: torch.Tensor, label: str | None) -> str:
    """What a collective carries, identical on every rank that issues the matching call."""
    about = f" [{label}]" if label else ""
    return f"{op} of {purpose}{about} ({describe_tensor(payload)})"


def in_flight(work: dist.Work | Sequence[dist.Work] | None) -> bool:
    """Whether the backend returned work still to wait for (the shared-memory path returns
    none: it completes inside the call)."""
    return work is not None and (isinstance(work, dist.Work) or len(work) > 0)


def failure_message(
    what: str,
    exc: BaseException,
    hint: str = COLLECTIVE_HINT,
    explain: Callable[[], str] | None = None,
) -> str:
    """``what`` failed because of ``exc``; shared-memory errors already explain themselves
    (they name the late or mismatched ranks), anything else gets ``explain()`` (which
    ranks are gone, with their hosts), followed by ``hint`` where that named none."""
    if isinstance(exc, shm.ShmMismatchError):
        return f"{what}: {exc}"
    if isinstance(exc, (shm.ShmPeerError, CollectiveError)):  # already names the ranks
        return f"{what} failed: {exc}"
    named = explain() if explain is not None else ""
    if not named or named.startswith(liveness.CANNOT_TELL):  # no rank to blame: the hint too
        named += " " + hint
    return f"{what} failed: {exc}.{named}"

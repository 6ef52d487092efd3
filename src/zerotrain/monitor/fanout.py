"""``Monitors``: the enabled backends behind one ``write``/``close``, live on rank 0 only."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from zerotrain.monitor.base import Event, Monitor, check_dependency, checked_events
from zerotrain.monitor.csv_monitor import CsvMonitor
from zerotrain.monitor.policy import MonitorKind, MonitorPolicy
from zerotrain.monitor.tensorboard_monitor import TensorBoardMonitor
from zerotrain.monitor.wandb_monitor import WandbMonitor


def build_monitor(policy: MonitorPolicy) -> Monitor:
    """Construct the backend ``policy.kind`` names (whether or not it is enabled).

    Raises:
        ImportError: the backend's package is not installed.
    """
    if policy.kind is MonitorKind.TENSORBOARD:
        return TensorBoardMonitor(policy)
    if policy.kind is MonitorKind.CSV:
        return CsvMonitor(policy)
    return WandbMonitor(policy)


class Monitors:
    """Fan-out to every enabled monitor; writes happen on rank 0 and nowhere else.

    Every rank builds one with the same policies: on rank 0 it owns the backends, elsewhere
    it is empty and ``write`` only validates. Whether a package is missing is checked on
    every rank, so a bad setup stops the whole job at start-up.

    Typical engine use::

        monitors = Monitors(policies, rank=rank)
        if monitors.active:          # rank 0 with something enabled: worth a .item() sync
            monitors.write([(tags.TRAIN_LOSS, loss.item(), samples), ...])
        ...
        monitors.close()

    Args:
        policies: one per config section; disabled ones are ignored.
        rank: this process's global rank (passed in: this package never calls
            ``torch.distributed``).

    Raises:
        ValueError: ``rank`` is negative, or two enabled policies have the same kind.
        ImportError: an enabled backend's package is not installed (on every rank).
    """

    def __init__(self, policies: Sequence[MonitorPolicy], *, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Monitors: rank must be an int >= 0, got {rank!r}")
        enabled = [p for p in policies if p.enabled]
        kinds = [p.kind for p in enabled]
        for kind in set(kinds):
            if kinds.count(kind) > 1:
                raise ValueError(
                    f"Monitors: '{kind.value}' is enabled by {kinds.count(kind)} policies"
                )
        for policy in enabled:
            check_dependency(policy.kind)
        self.rank = rank
        self.policies: tuple[MonitorPolicy, ...] = tuple(enabled)
        self._monitors: list[Monitor] = []
        self._closed = False
        if rank == 0:
            self._build(enabled)

    def _build(self, enabled: Sequence[MonitorPolicy]) -> None:
        try:
            for policy in enabled:
                self._monitors.append(build_monitor(policy))
        except BaseException:
            # Do not leave a half-built set behind (an open wandb run keeps a service alive).
            self.close()
            raise

    @property
    def configured(self) -> bool:
        """Whether any monitor is enabled in the config; the same on every rank (use it to
        decide on collectives that gather figures for rank 0, such as per-rank memory)."""
        return bool(self.policies)

    @property
    def active(self) -> bool:
        """Whether this rank writes anything (rank 0 with at least one monitor, not closed)."""
        return bool(self._monitors) and not self._closed

    @property
    def monitors(self) -> tuple[Monitor, ...]:
        """The backends this rank owns, in policy order (empty off rank 0)."""
        return tuple(self._monitors)

    def write(self, events: Sequence[Event]) -> None:
        """Validate ``events`` on every rank and pass them to each backend on rank 0.

        Raises:
            RuntimeError: called after :meth:`close`.
            TypeError, ValueError: a malformed event (see :func:`checked_events`).
        """
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: Monitors.write after close()")
        checked = checked_events(events)
        for monitor in self._monitors:
            monitor.write(checked)

    def close(self) -> None:
        """Close every backend, even if one fails (the first error is raised afterwards).
        Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for monitor in self._monitors:
            try:
                monitor.close()
            except Exception as err:
                first_error = first_error or err
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Monitors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

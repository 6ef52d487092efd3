"""The communicator of a group of one rank: every collective is a local copy.

Axes of size 1 (no pipeline, no tensor parallelism) are the common case. A process group
per such axis would cost each rank backend threads and a rendezvous for nothing, so their
communicator moves data locally. Calls are still counted in ``stats`` and timed by the
comms logger, so code and accounting stay the same whatever the group's size.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch

from zerotrain.comm.collectives import Communicator, Handle, P2POp
from zerotrain.comm.comms_logger import CommsLogger
from zerotrain.comm.stats import CommStats


def _copy(source: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    """The whole collective over one rank: ``target`` takes ``source``'s elements (nothing
    to do when it is ``source`` itself, an in-place call)."""

    def run() -> None:
        if target.data_ptr() != source.data_ptr():
            target.view(-1).copy_(source.view(-1))

    return run


class LocalCommunicator(Communicator):
    """A :class:`Communicator` over this rank alone (rank 0 of 1); no process group.

    Args:
        device: where small control tensors live.
        timeout: kept for symmetry with the other communicators (nothing waits here).
    """

    def __init__(
        self, device: torch.device, timeout: datetime.timedelta | None = None
    ) -> None:  # no super().__init__(): it would query a process group
        self.group = None
        self.rank = 0
        self.world_size = 1
        self.backend = "local"
        self.timeout = timeout
        self.device = device
        self.stats = CommStats()
        self.comms_logger = CommsLogger(1)
        self._shm = None
        self._verify = False
        self._native = {}

    def _local(
        self,
        op: str,
        purpose: str,
        payload: torch.Tensor,
        copy: Callable[[], None] | None,
        on_done: Callable[[], None] | None,
        label: str | None,
        detail: str = "",
    ) -> Handle:
        def call(_signature: str) -> None:
            if copy is not None:
                copy()

        return self._run(op, purpose, payload, call, False, on_done, label, detail)

    @property
    def shared_memory_peers(self) -> tuple[int, ...]:
        """No peer: nothing goes through shared memory."""
        return ()

    @property
    def open_p2p_channels(self) -> int:
        """No peer, no channel."""
        return 0

    def reduces_natively(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Nothing is reduced across ranks: every dtype works."""
        return True

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        purpose: str,
        op: str = "sum",
        async_op: bool = False,
        on_done: Callable[[], None] | None = None,
        label: str | None = None,
    ) -> Handle:
        """The sum (max, min) over one rank is the tensor itself."""
        return self._local("all_reduce", purpose, tensor, None, on_done, label, f"({op})")

    def reduce_scatter(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        *,
        purpose: str,
        async_op: bool = False,
        on_done: Callable[[], None] | None = None,
        label: str | None = None,
    ) -> Handle:
        """``output`` receives ``full`` (its only chunk)."""
        return self._local("reduce_scatter", purpose, full, _copy(full, output), on_done, label)

    def all_gather_into(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        *,
        purpose: str,
        async_op: bool = False,
        on_done: Callable[[], None] | None = None,
        label: str | None = None,
    ) -> Handle:
        """``output`` receives ``shard`` (the only one)."""
        return self._local("all_gather", purpose, output, _copy(shard, output), on_done, label)

    def broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, purpose: str, async_op: bool = False
    ) -> Handle:
        """Rank 0 already holds its own values."""
        if src != 0:
            raise ValueError(f"broadcast from rank {src} in a group of one rank (only 0)")
        return self._local("broadcast", purpose, tensor, None, None, None, f"(from {src})")

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        purpose: str,
        label: str | None = None,
        async_op: bool = False,
        on_done: Callable[[], None] | None = None,
    ) -> Handle:
        """Every row goes to this rank: ``output`` receives ``input``."""
        for name, splits in (("input", input_split_sizes), ("output", output_split_sizes)):
            if splits is not None and list(splits) != [input.shape[0]]:
                raise ValueError(
                    f"all_to_all over one rank: {name}_split_sizes={list(splits)}, but the "
                    f"only split must hold all {input.shape[0]} rows"
                )
        if output.shape != input.shape:
            raise ValueError(
                f"all_to_all over one rank: output {tuple(output.shape)} must have the "
                f"shape of input {tuple(input.shape)}"
            )
        return self._local("all_to_all", purpose, input, _copy(input, output), on_done, label)

    def exchange(self, ops: Sequence[P2POp], *, async_op: bool = False) -> Handle:
        """There is no peer in a group of one rank: any send or receive is refused."""
        if ops:
            raise ValueError(
                f"{ops[0].kind} with peer {ops[0].peer} in a group of one rank: there is no "
                "other rank to exchange with"
            )
        return Handle(None, lambda: "empty exchange")

    def post_in_order(self, ops: Sequence[P2POp]) -> list[Handle]:
        """As :meth:`exchange`: nothing to post to in a group of one rank."""
        self.exchange(ops)
        return []

    def abandon_posted(self, reason: str) -> None:
        """Nothing was posted to anyone."""

    def barrier(self) -> None:
        """Nobody else to wait for."""

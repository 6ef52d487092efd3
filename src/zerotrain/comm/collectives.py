"""The only module that calls ``torch.distributed`` collectives (with ``p2p.py``, which issues
the point-to-point batches the :class:`Communicator` hands it).

Every call goes through a :class:`Communicator`, which counts it in :class:`CommStats`, times
it when the comms logger profiles it (see ``comms_logger.py``), and turns a failure (a peer
that died, a rank that took another code path until the timeout) into a
:class:`CollectiveError` naming the rank, the collective and what it carried.
Asynchronous calls return a :class:`Handle` with an explicit ``wait()``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist

from zerotrain.comm import liveness, shm
from zerotrain.comm.comms_logger import CommsLogger, CommsLoggerPolicy, CommsSummary
from zerotrain.comm.handle import CollectiveError, Handle, failure_message, in_flight
from zerotrain.comm.handle import signature as signature_of
from zerotrain.comm.p2p import P2POp, PeerToPeer
from zerotrain.comm.shm_group import open_group_arena
from zerotrain.comm.splits import check_tensors, resolve_splits
from zerotrain.comm.stats import CommSnapshot, CommStats
from zerotrain.comm.verify import verify_signature, verify_splits
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

__all__ = ["CollectiveError", "Communicator", "Handle", "P2POp"]

_REDUCE_OPS = MappingProxyType(
    {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
)


def _verification_enabled() -> bool:
    """``ZEROTRAIN_VERIFY_COLLECTIVES=0`` turns signature and header checks off."""
    return os.environ.get("ZEROTRAIN_VERIFY_COLLECTIVES", "1") != "0"


class Communicator:
    """Collectives over one process group, counted in ``stats``.

    Every collective is issued asynchronously and waited on through a :class:`Handle`, so
    blocking and non-blocking calls fail the same way, after the same ``timeout``.

    Args:
        group: the process group (None = the default group).
        timeout: how long a wait lasts before raising ``CollectiveError`` (gloo). NCCL waits
            are left to the process group's own watchdog: a host-side timed wait on NCCL
            would block the CPU until the GPU finished, defeating overlap.
        device: where small control tensors (loss averages, flags) live; default: CUDA's
            current device for NCCL, else CPU.
        shared_memory: run CPU collectives through a shared-memory arena when every rank is
            on this machine, and point-to-point messages through pairwise shared-memory
            channels with the peers that are (default: when supported; ``ZEROTRAIN_SHM=0``
            disables both).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        device: torch.device | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        invariant(dist.is_initialized(), "Communicator needs an initialised process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = timeout if self.backend == "gloo" else None
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if self.backend == "nccl"
                else torch.device("cpu")
            )
        self.device = device
        self.stats = CommStats()
        self.comms_logger = CommsLogger(self.world_size)  # disabled until configure_logger
        if self.world_size > 1:  # heartbeats name a rank that stops answering (once per process)
            store_timeout = timeout or datetime.timedelta(seconds=60)
            liveness.start_store_heartbeats(
                dist.get_rank(), lambda: liveness.store_client(store_timeout)
            )
        if shared_memory is None:
            shared_memory = self.backend == "gloo" and self.world_size > 1
        self._shm, pairs = (
            open_group_arena(group, self.rank, self.world_size, self.timeout, self._global)
            if shared_memory
            else (None, None)
        )
        # Over plain gloo, ranks in mismatched collectives abort inside gloo (or exchange the
        # wrong data when sizes agree); a tiny signature check before each one turns that
        # into a clear error on every rank. The shared-memory path checks signatures itself.
        self._verify = (
            self.backend == "gloo"
            and self._shm is None
            and self.world_size > 1
            and _verification_enabled()
        )
        # Point-to-point has its own pairwise channels to the peers on this machine (the
        # arena synchronises the whole group); the header check depends only on the backend.
        self._p2p = PeerToPeer(
            group=group,
            rank=self.rank,
            world_size=self.world_size,
            to_global=self._global,
            timeout=self.timeout,
            verify=self.backend == "gloo" and _verification_enabled(),
            stats=self.stats,
            logger=self.comms_logger,
            pairs=pairs,
        )
        # Whether the backend reduces a 16-bit float dtype on a device type (gloo lacks
        # bf16 in some torch builds, and for CUDA tensors); filled in on first use.
        self._native: dict[tuple[str, torch.dtype], bool] = {}

    @property
    def uses_shared_memory(self) -> bool:
        """Whether CPU collectives go through a shared-memory arena."""
        return self._shm is not None

    @property
    def shared_memory_peers(self) -> tuple[int, ...]:
        """Group ranks whose point-to-point messages can go through shared memory."""
        pairs = self._p2p.pairs
        return tuple(r for r in range(self.world_size) if pairs is not None and pairs.is_local(r))

    @property
    def open_p2p_channels(self) -> int:
        """Shared-memory point-to-point channels this rank has mapped (opened on first use,
        one per peer; ``PairSettings.segment_bytes()`` each)."""
        return self._p2p.pairs.open_channels if self._p2p.pairs is not None else 0

    def _shared(self, *tensors: torch.Tensor) -> shm.ShmCollectives | None:
        """The shared-memory path, when it applies to these tensors."""
        if self._shm is not None and all(t.device.type == "cpu" for t in tensors):
            return self._shm
        return None

    def snapshot(self) -> CommSnapshot:
        """Counts of every collective issued so far (see ``CommStats``)."""
        return self.stats.snapshot()

    def configure_logger(self, policy: CommsLoggerPolicy) -> None:
        """Time collectives issued from now on as ``policy`` says (``comms_logger`` config).

        Measurements recorded so far are kept; ``comms_logger.reset()`` forgets them.
        """
        self.comms_logger.policy = policy

    def comms_summary(self) -> CommsSummary:
        """Latency and bandwidth of every profiled collective completed so far (empty when
        the logger is disabled); ``str()`` of it is a table."""
        return self.comms_logger.summary()

    # -- plumbing ---------------------------------------------------------------------------

    def _run(
        self,
        op: str,
        purpose: str,
        payload: torch.Tensor,
        call: Callable[[str], dist.Work | Sequence[dist.Work] | None],
        async_op: bool,
        on_done: Callable[[], None] | None = None,
        label: str | None = None,
        detail: str = "",
        common: str | None = None,
        check: Callable[[], None] | None = None,
        signed: bool = False,
    ) -> Handle:
        """Count and issue one collective. ``call`` receives its signature (``op`` with
        ``detail``, e.g. the reduce op; or ``common`` where the payload's shape may differ
        between ranks), which every rank must agree on, when ``signed`` (the call needs it)
        or signatures are checked over gloo, and "" otherwise. ``check`` runs after the
        signature check, when signatures are checked over gloo (e.g. all-to-all splits)."""
        nbytes = payload.numel() * payload.element_size()
        # Built only where something checks it: the gloo signature check, or shared memory
        # (which publishes it on every collective). A string per collective is host work.
        signature = ""
        if self._verify or signed:
            signature = (
                common if common is not None else signature_of(op + detail, purpose, payload, label)
            )

        def describe() -> str:
            return f"rank {self.rank}: {signature_of(op, purpose, payload, label)}"

        self.stats.record(op, purpose, nbytes)
        if self._verify:
            verify_signature(self.group, self.rank, self.timeout, signature, self._explain)
            if check is not None:
                check()
        # The clock starts after the signature check: that is not part of the collective, and
        # it has just lined the ranks up, so less of another rank's lateness is counted.
        timer = self.comms_logger.start(op, purpose, nbytes, payload.device, label)
        try:
            work = call(signature)
        except Exception as exc:
            raise CollectiveError(failure_message(describe(), exc, explain=self._explain)) from exc
        if timer is not None:
            if in_flight(work):
                # Known complete only when waited; for an async call the caller may overlap
                # other work before that, which the sample then includes (marked overlapped).
                on_done = timer.stopping(on_done, overlapped=async_op)
            else:
                timer.stop(overlapped=False)  # finished inside the call (shared memory)
        handle = Handle(work, describe, on_done, self.timeout, explain=self._explain)
        if not async_op:
            handle.wait()
        return handle

    def _alone(
        self,
        op: str,
        purpose: str,
        payload: torch.Tensor,
        on_done: Callable[[], None] | None,
        output: torch.Tensor | None = None,
        source: torch.Tensor | None = None,
    ) -> Handle:
        """A collective over one rank: no backend call (a one-rank gloo or NCCL
        collective still costs a launch and its bookkeeping), only ``source`` copied into
        ``output`` where they are different tensors. Counted in the stats like any other;
        its handle is already complete (``on_done`` has run)."""
        self.stats.record(op, purpose, payload.numel() * payload.element_size())
        if output is not None and source is not None and output.data_ptr() != source.data_ptr():
            # Flat buffers (the common case) are copied as they are: no view ops per call.
            flat_out = output if output.dim() == 1 else output.view(-1)
            flat_source = source if source.dim() == 1 else source.reshape(-1)
            flat_out.copy_(flat_source)
        handle = Handle(None, lambda: f"rank {self.rank}: {op} of {purpose}", on_done)
        handle.wait()
        return handle

    def _explain(self) -> str:
        """Which of this group's ranks stopped answering (after a failure; waits a few
        seconds for their heartbeats)."""
        return liveness.explain_failure([self._global(r) for r in range(self.world_size)])

    def reduces_natively(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the backend can reduce ``dtype`` tensors on ``device``'s type. Where it
        cannot, reductions run on an fp32 copy (exact for 16-bit inputs, rounded once)."""
        if dtype not in (torch.bfloat16, torch.float16) or self.backend != "gloo":
            return True
        key = (device.type, dtype)
        if key not in self._native:
            # Every rank runs the same torch build, so all of them fail here alike.
            probe = torch.ones(1, dtype=dtype, device=device)
            try:
                dist.all_reduce(probe, group=self.group)
                self._native[key] = float(probe.item()) == self.world_size
            except RuntimeError:
                self._native[key] = False
            if not self._native[key]:
                log.info("gloo cannot reduce %s on %s: reducing an fp32 copy", dtype, key[0])
        return self._native[key]

    def _needs_bit_view(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.bfloat16 and not self.reduces_natively(
            tensor.dtype, tensor.device
        )

    # -- collectives ------------------------------------------------------------------------

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
        """Reduce ``tensor`` in place across ranks (``op``: sum, max or min).

        ``on_done`` runs (on the waiting thread) once the result is in ``tensor``; ``label``
        names what the tensor belongs to in error messages.
        """
        reduce_op = _REDUCE_OPS[op]
        if self.world_size == 1:  # sum, max or min of one value: the value
            return self._alone("all_reduce", purpose, tensor, on_done)
        shared = self._shared(tensor)
        if shared is None and not self.reduces_natively(tensor.dtype, tensor.device):
            wide = tensor.float()

            def narrow() -> None:
                tensor.copy_(wide)
                if on_done is not None:
                    on_done()

            return self.all_reduce(
                wide, purpose=purpose, op=op, async_op=async_op, on_done=narrow, label=label
            )
        if shared is not None:
            return self._run(
                "all_reduce",
                purpose,
                tensor,
                lambda signature: shared.all_reduce(tensor, op, signature),
                async_op,
                on_done,
                label,
                detail=f"({op})",
                signed=True,
            )
        return self._run(
            "all_reduce",
            purpose,
            tensor,
            lambda _: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True),
            async_op,
            on_done,
            label,
            detail=f"({op})",
        )

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
        """Sum ``full`` across ranks; rank r receives chunk r into ``output``.

        ``full`` must hold ``world_size * output.numel()`` elements; ``output`` may be this
        rank's chunk of ``full`` itself (in place). The other chunks of ``full`` are left
        undefined.
        """
        invariant(
            full.numel() == output.numel() * self.world_size,
            f"reduce_scatter: full has {full.numel()} elements, expected "
            f"{output.numel()} x {self.world_size}",
        )
        if self.world_size == 1:
            return self._alone("reduce_scatter", purpose, full, on_done, output, full)
        shared = self._shared(output, full)
        if shared is None and not self.reduces_natively(full.dtype, full.device):
            wide = full.float()
            mine = wide.view(self.world_size, -1)[self.rank]

            def narrow() -> None:
                output.view(-1).copy_(mine)
                if on_done is not None:
                    on_done()

            return self.reduce_scatter(
                mine, wide, purpose=purpose, async_op=async_op, on_done=narrow, label=label
            )
        if shared is not None:
            return self._run(
                "reduce_scatter",
                purpose,
                full,
                lambda signature: shared.reduce_scatter(output, full, signature),
                async_op,
                on_done,
                label,
                signed=True,
            )
        if self.backend != "gloo":
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return self._run(
                "reduce_scatter",
                purpose,
                full,
                lambda _: fn(output, full, group=self.group, async_op=True),
                async_op,
                on_done,
                label,
            )
        # gloo's reduce-scatter is slower than its all-reduce; one reduce per chunk, each to
        # the rank that owns it, moves the same bytes and runs about twice as fast.
        chunks = full.view(self.world_size, -1)
        mine = chunks[self.rank]

        def finish() -> None:
            if output.data_ptr() != mine.data_ptr():
                output.view(-1).copy_(mine)
            if on_done is not None:
                on_done()

        return self._run(
            "reduce_scatter",
            purpose,
            full,
            lambda _: [
                dist.reduce(chunks[k], dst=self._global(k), group=self.group, async_op=True)
                for k in range(self.world_size)
            ],
            async_op,
            finish,
            label,
        )

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
        """Concatenate every rank's ``shard`` into ``output`` (rank order); ``shard`` may be
        this rank's chunk of ``output`` itself (in place)."""
        invariant(
            output.numel() == shard.numel() * self.world_size,
            f"all_gather: output has {output.numel()} elements, expected "
            f"{shard.numel()} x {self.world_size}",
        )
        if self.world_size == 1:
            return self._alone("all_gather", purpose, output, on_done, output, shard)
        shared = self._shared(output, shard)
        if shared is None and self._needs_bit_view(output):
            # Moving bytes needs no arithmetic: the same bits as fp16, which gloo carries.
            return self.all_gather_into(
                output.view(torch.float16),
                shard.view(torch.float16),
                purpose=purpose,
                async_op=async_op,
                on_done=on_done,
                label=label,
            )
        if shared is not None:
            return self._run(
                "all_gather",
                purpose,
                output,
                lambda signature: shared.all_gather(output, shard, signature),
                async_op,
                on_done,
                label,
                signed=True,
            )
        if self.backend != "gloo":
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return self._run(
                "all_gather",
                purpose,
                output,
                lambda _: fn(output, shard, group=self.group, async_op=True),
                async_op,
                on_done,
                label,
            )
        # gloo's all-gather is slower than a broadcast of each rank's chunk (same bytes).
        chunks = output.view(self.world_size, -1)
        if shard.data_ptr() != chunks[self.rank].data_ptr():
            chunks[self.rank].copy_(shard.view(-1))
        return self._run(
            "all_gather",
            purpose,
            output,
            lambda _: [
                dist.broadcast(chunks[k], src=self._global(k), group=self.group, async_op=True)
                for k in range(self.world_size)
            ],
            async_op,
            on_done,
            label,
        )

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
        """Scatter rows of ``input`` to every rank and gather theirs into ``output`` (dim 0,
        like ``torch.distributed.all_to_all_single``).

        Rank i sends its ``input_split_sizes[j]`` rows for rank j (in rank order) and
        receives rank j's rows for it into ``output`` at ``output_split_sizes[j]`` rows per
        rank. Over gloo the ranks check first that they are in the same all-to-all (purpose,
        label, dtype, row shape) and that every pair's splits agree.

        Args:
            output: receives the rows, contiguous, same dtype and row shape as ``input``.
            input: the rows to send, contiguous, at least 1-D.
            output_split_sizes / input_split_sizes: rows from / to each rank (None: equal
                parts of dim 0); entries may be 0.
            purpose / label: why and for what it runs (counts, logs and errors).
            async_op: return at once; ``wait()`` the handle before reading ``output``.
            on_done: run once the rows are in ``output``.

        Returns:
            A :class:`Handle` (already waited on unless ``async_op``).

        Raises:
            ValueError: splits of the wrong length, with negative entries or that do not
                sum to dim 0; tensors that differ in dtype, device or row shape.
            CollectiveError: the ranks' calls or splits disagree, a peer failed, or the
                timeout passed (every rank raises, naming the disagreement).
        """
        check_tensors(output, input)
        n = self.world_size
        sends = resolve_splits(input_split_sizes, input.shape[0], n, "input_split_sizes")
        recvs = resolve_splits(output_split_sizes, output.shape[0], n, "output_split_sizes")
        # Sizes along dim 0 differ between ranks; what every rank agrees on is the rest.
        row = "x".join(str(d) for d in input.shape[1:]) or "scalars"
        dtype = str(input.dtype).removeprefix("torch.")
        about = f" [{label}]" if label else ""
        common = f"all_to_all of {purpose}{about} ({dtype} rows of {row})"
        if n == 1:
            return self._alone("all_to_all", purpose, input, on_done, output, input)
        shared = self._shared(output, input)
        if shared is not None:
            return self._run(
                "all_to_all",
                purpose,
                input,
                lambda signature: shared.all_to_all(output, input, (sends, recvs), signature),
                async_op,
                on_done,
                label,
                common=common,
                signed=True,
            )
        if self._needs_bit_view(input):
            return self.all_to_all(
                output.view(torch.float16),
                input.view(torch.float16),
                output_split_sizes=recvs,
                input_split_sizes=sends,
                purpose=purpose,
                label=label,
                async_op=async_op,
                on_done=on_done,
            )
        return self._run(
            "all_to_all",
            purpose,
            input,
            lambda _: dist.all_to_all_single(
                output,
                input,
                output_split_sizes=recvs,
                input_split_sizes=sends,
                group=self.group,
                async_op=True,
            ),
            async_op,
            on_done,
            label,
            common=common,
            check=lambda: verify_splits(
                self.group, self.rank, self.timeout, (sends, recvs), common, self._explain
            ),
        )

    # -- point to point ---------------------------------------------------------------------

    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        *,
        purpose: str,
        label: str | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Send ``tensor`` (contiguous) to rank ``dst`` of this group: a one-op
        :meth:`exchange`, matched with the peer's ``recv`` by the header check.

        Returns:
            A :class:`Handle` (waited on unless ``async_op``).

        Raises:
            ValueError / CollectiveError: as for :meth:`exchange`.
        """
        return self.exchange(
            [P2POp.send(tensor, dst, purpose=purpose, label=label)], async_op=async_op
        )

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        *,
        purpose: str,
        label: str | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Receive into ``tensor`` (contiguous, the sent shape and dtype) from rank ``src``
        of this group: a one-op :meth:`exchange`.

        Returns:
            A :class:`Handle`; read ``tensor`` after its ``wait()``.

        Raises:
            ValueError / CollectiveError: as for :meth:`exchange`.
        """
        return self.exchange(
            [P2POp.recv(tensor, src, purpose=purpose, label=label)], async_op=async_op
        )

    def exchange(self, ops: Sequence[P2POp], *, async_op: bool = False) -> Handle:
        """Issue point-to-point sends and receives together (``batch_isend_irecv``), so a
        ring shifting both ways at once cannot deadlock.

        Each op counts in ``stats`` as ``send`` or ``recv`` with its tensor's bytes. Over
        gloo each rank first swaps a small header with every peer of the batch, so a pair
        whose calls differ (shape, dtype, purpose, label, or a send met by a send) fails on
        both sides naming both, and a peer that never calls fails by name after the
        timeout; calls between two ranks are matched in the order they issue them
        (``ZEROTRAIN_VERIFY_COLLECTIVES=0`` turns this off). See ``comm/p2p.py``.

        Args:
            ops: :class:`P2POp` (``P2POp.send(t, dst, purpose=...)``, ``P2POp.recv(...)``),
                peers given as ranks in this group; several ops may share a peer (they
                pair up in order). An empty list does nothing.
            async_op: return once issued (after the header round trip); ``wait()`` the
                handle before reading received tensors or changing sent ones.

        Returns:
            One :class:`Handle` for the whole batch.

        Raises:
            ValueError: a peer outside the group or equal to this rank, or a
                non-contiguous tensor.
            CollectiveError: the peer's calls differ, it never issued them within the
                timeout, or the transfer failed.
        """
        return self._p2p.exchange(ops, async_op=async_op)

    def post_in_order(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Issue point-to-point sends and receives as one batch, in order, and return at
        once with a handle per op: the pipeline's one entry point.

        Between two ranks messages match in the order each posts them, as NCCL matches
        them whatever the tags (NCCL: one ``batch_isend_irecv``, one group). Callers post
        in mirrored orders (``parallel/pipeline/plan.py`` derives them from the schedule).
        Over gloo, CPU messages to a peer on this machine go through a shared-memory
        mailbox (``shm_mailbox.py``): a send completes as soon as its message is in the
        pair's slots, without waiting for the receiver, messages match by order, and each
        carries a header the receiver checks, so a mis-ordered one fails there naming both
        ranks and both messages. Messages to other machines go over gloo and match by
        ``P2POp.tag``. ``ZEROTRAIN_P2P_MATCH=order`` sends every message over gloo instead,
        matched by order under one tag, as NCCL does, each after a header that the
        receiver checks before the data arrives (the receive then waits at posting for its
        header: a checking mode, for CPU runs and tests). ``wait()`` a receive's handle
        before reading it, a send's before changing or freeing its tensor. Counted in
        ``stats`` like :meth:`exchange`.

        Raises:
            ValueError: as for :meth:`exchange`, or a bad ``ZEROTRAIN_P2P_MATCH``.
            CollectiveError: the backend refused an op, or a message that is not the one
                expected (mailbox, order mode); on ``wait()``, a peer that never posted the
                matching op within the timeout, exited, stopped answering, or abandoned
                its step (mailbox).
        """
        return self._p2p.post_in_order(ops)

    def abandon_posted(self, reason: str) -> None:
        """After a failure with messages of :meth:`post_in_order` outstanding: peers on this
        machine waiting for this rank's messages raise at once, quoting ``reason``, instead
        of waiting out the timeout (peers on other machines still time out). Later
        mailbox calls on this communicator raise."""
        self._p2p.abandon_posted(reason)

    def _global(self, rank: int) -> int:
        """The default-group rank of ``rank`` in this communicator's group."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, purpose: str, async_op: bool = False
    ) -> Handle:
        """Copy rank ``src``'s ``tensor`` to every rank (``src`` is a rank in this group)."""
        if self.world_size == 1:
            return self._alone("broadcast", purpose, tensor, None)
        shared = self._shared(tensor)
        if shared is None and self._needs_bit_view(tensor):
            return self.broadcast(
                tensor.view(torch.float16), src=src, purpose=purpose, async_op=async_op
            )
        if shared is not None:
            return self._run(
                "broadcast",
                purpose,
                tensor,
                lambda signature: shared.broadcast(tensor, src, signature),
                async_op,
                detail=f"(from {src})",
                signed=True,
            )
        global_src = self._global(src)
        return self._run(
            "broadcast",
            purpose,
            tensor,
            lambda _: dist.broadcast(tensor, src=global_src, group=self.group, async_op=True),
            async_op,
            detail=f"(from {src})",
        )

    def all_reduce_floats(self, values: Sequence[float], *, op: str = "sum") -> list[float]:
        """Reduce a few Python floats (losses, flags) in one small collective."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self.all_reduce(tensor, purpose="control", op=op)
        return tensor.cpu().tolist()

    def barrier(self) -> None:
        """Wait until every rank reaches this point (or fail after the timeout)."""
        try:
            if self._shm is not None:
                self._shm.barrier()
            elif self.backend == "gloo" and self.timeout is not None:
                # gloo's monitored barrier names the ranks that never arrived.
                dist.monitored_barrier(group=self.group, timeout=self.timeout)
            else:
                dist.barrier(group=self.group)
        except Exception as exc:
            message = failure_message(f"rank {self.rank}: barrier", exc, explain=self._explain)
            raise CollectiveError(message) from exc

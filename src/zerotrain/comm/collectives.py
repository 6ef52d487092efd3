"""The only module that calls ``torch.distributed`` collectives.

Every call goes through a :class:`Communicator`, which counts it in :class:`CommStats`, times
it when the comms logger profiles it (see ``comms_logger.py``), and turns a failure (a peer
that died, a rank that took another code path until the timeout) into a
:class:`CollectiveError` naming the rank, the collective and what it carried.
Asynchronous calls return a :class:`Handle` with an explicit ``wait()``.
"""

from __future__ import annotations

import datetime
import os
import uuid
import zlib
from collections.abc import Callable, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist

from zerotrain.comm import shm
from zerotrain.comm.comms_logger import CommsLogger, CommsLoggerPolicy, CommsSummary
from zerotrain.comm.stats import CommSnapshot, CommStats
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_REDUCE_OPS = MappingProxyType(
    {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the collective."""


class Handle:
    """An issued collective (possibly several backend operations). ``wait()`` blocks until
    all of them finished, then runs ``on_done``."""

    def __init__(
        self,
        work: dist.Work | Sequence[dist.Work] | None,
        describe: Callable[[], str],
        on_done: Callable[[], None] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        if work is None:
            work = []
        self._works = [work] if isinstance(work, dist.Work) else list(work)
        self._describe = describe
        self._on_done = on_done
        self._timeout = timeout
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once ``wait()`` has returned."""
        return self._finished

    def wait(self) -> None:
        """Block until the collective completed (idempotent)."""
        if self._finished:
            return
        try:
            for work in self._works:
                if self._timeout is None:
                    work.wait()
                else:
                    work.wait(self._timeout)
        except Exception as exc:
            raise CollectiveError(_failure_message(self._describe(), exc)) from exc
        self._finished = True
        if self._on_done is not None:
            self._on_done()


def _signature(op: str, purpose: str, payload: torch.Tensor, label: str | None) -> str:
    """What a collective carries, identical on every rank that issues the matching call."""
    nbytes = payload.numel() * payload.element_size()
    about = f" [{label}]" if label else ""
    return (
        f"{op} of {purpose}{about} ({tuple(payload.shape)} "
        f"{str(payload.dtype).removeprefix('torch.')}, {nbytes} bytes)"
    )


def _in_flight(work: dist.Work | Sequence[dist.Work] | None) -> bool:
    """Whether the backend returned work still to wait for (the shared-memory path returns
    none: it completes inside the call)."""
    return work is not None and (isinstance(work, dist.Work) or len(work) > 0)


def _failure_message(what: str, exc: BaseException) -> str:
    if isinstance(exc, shm.ShmMismatchError):
        return f"{what}: {exc}"
    return (
        f"{what} failed: {exc}. Another rank probably exited, or the ranks issued different "
        "collectives (different code paths or models); see the other ranks' output."
    )


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
            on this machine (default: when supported; ``ZEROTRAIN_SHM=0`` disables it).
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
        if shared_memory is None:
            shared_memory = self.backend == "gloo" and self.world_size > 1
        self._shm = self._open_shared_memory() if shared_memory else None
        # Over plain gloo, ranks in mismatched collectives abort inside gloo (or exchange the
        # wrong data when sizes agree); a tiny signature check before each one turns that
        # into a clear error on every rank. The shared-memory path checks signatures itself.
        self._verify = (
            self.backend == "gloo"
            and self._shm is None
            and self.world_size > 1
            and os.environ.get("ZEROTRAIN_VERIFY_COLLECTIVES", "1") != "0"
        )
        # Whether the backend reduces a 16-bit float dtype on a device type (gloo lacks
        # bf16 in some torch builds, and for CUDA tensors); filled in on first use.
        self._native: dict[tuple[str, torch.dtype], bool] = {}

    @property
    def uses_shared_memory(self) -> bool:
        """Whether CPU collectives go through a shared-memory arena."""
        return self._shm is not None

    def _open_shared_memory(self) -> shm.ShmCollectives | None:
        """Set up the arena if every rank is on this machine; every rank agrees or none uses
        it (a rank that fails to map the segment makes all of them fall back to gloo)."""
        # Each rank reads its own environment; the decision and the slot size must be the
        # same everywhere (different slot sizes would silently misplace data).
        try:
            slot_bytes, problem = shm.slot_bytes_from_env(), None
        except ValueError as err:
            slot_bytes, problem = 0, str(err)
        mine = (shm.host_identity(), shm.supported(), slot_bytes, problem)
        infos: list[tuple[str, bool, int, str | None] | None] = [None] * self.world_size
        dist.all_gather_object(infos, mine, group=self.group)
        seen = [info for info in infos if info is not None]
        problems = [f"rank {r}: {info[3]}" for r, info in enumerate(seen) if info[3]]
        if problems:
            raise ValueError("; ".join(problems))
        if len({info[0] for info in seen}) != 1 or not all(info[1] for info in seen):
            return None
        slot_bytes = seen[0][2]
        if len({info[2] for info in seen}) != 1:
            log.warning(
                "ZEROTRAIN_SHM_SLOT_BYTES differs between ranks; using rank 0's (%d)", slot_bytes
            )

        def open_arena(name: str, create: bool) -> shm.ShmArena | None:
            try:
                return shm.ShmArena(
                    name,
                    self.rank,
                    self.world_size,
                    create,
                    self.timeout,
                    slot_bytes,
                )
            except OSError as err:
                log.warning("rank %d: shared-memory collectives unavailable (%s)", self.rank, err)
                return None

        # Rank 0 creates the segment before anyone learns its name, so nobody opens too early.
        arena = open_arena(f"zerotrain-{uuid.uuid4().hex[:16]}", True) if self.rank == 0 else None
        names: list[str | None] = [arena.name if arena is not None else None]
        dist.broadcast_object_list(names, src=self._global(0), group=self.group)
        if self.rank != 0 and names[0] is not None:
            arena = open_arena(str(names[0]), False)
        ok = 1.0 if arena is not None else 0.0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)  # also: all attached
        if self.rank == 0 and arena is not None:
            arena.unlink()  # the memory lives while mapped; no name is left behind
        if flag.item() < 1.0:
            if arena is not None:
                arena.close()
            return None
        return shm.ShmCollectives(arena)  # type: ignore[arg-type]

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
    ) -> Handle:
        """Count and issue one collective. ``call`` receives its signature (``op`` with
        ``detail``, e.g. the reduce op), which every rank must agree on."""
        nbytes = payload.numel() * payload.element_size()
        signature = _signature(op + detail, purpose, payload, label)

        def describe() -> str:
            return f"rank {self.rank}: {_signature(op, purpose, payload, label)}"

        self.stats.record(op, purpose, nbytes)
        if self._verify:
            self._verify_signature(signature)
        # The clock starts after the signature check: that is not part of the collective, and
        # it has just lined the ranks up, so less of another rank's lateness is counted.
        timer = self.comms_logger.start(op, purpose, nbytes, payload.device, label)
        try:
            work = call(signature)
        except Exception as exc:
            raise CollectiveError(_failure_message(describe(), exc)) from exc
        if timer is not None:
            if _in_flight(work):
                # Known complete only when waited; for an async call the caller may overlap
                # other work before that, which the sample then includes (marked overlapped).
                on_done = timer.stopping(on_done, overlapped=async_op)
            else:
                timer.stop(overlapped=False)  # finished inside the call (shared memory)
        handle = Handle(work, describe, on_done, self.timeout)
        if not async_op:
            handle.wait()
        return handle

    def _verify_signature(self, signature: str) -> None:
        code = float(zlib.crc32(signature.encode()))
        both = torch.tensor([code, -code], dtype=torch.float64)
        try:
            work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait(self.timeout) if self.timeout is not None else work.wait()
        except Exception as exc:
            raise CollectiveError(
                _failure_message(f"rank {self.rank}: {signature} (signature check)", exc)
            ) from exc
        if both[0].item() != -both[1].item():
            raise CollectiveError(
                f"rank {self.rank}: the ranks entered different collectives (they took "
                f"different code paths, e.g. a module run on one rank and not another): "
                f"this rank is in {signature}, another rank in a different one"
            )

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

    def _global(self, rank: int) -> int:
        """The default-group rank of ``rank`` in this communicator's group."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def broadcast(
        self, tensor: torch.Tensor, *, src: int = 0, purpose: str, async_op: bool = False
    ) -> Handle:
        """Copy rank ``src``'s ``tensor`` to every rank (``src`` is a rank in this group)."""
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
            raise CollectiveError(_failure_message(f"rank {self.rank}: barrier", exc)) from exc

"""What ``offload_optimizer`` and ``offload_param`` change, in one place.

``Offload`` is created before the units are built. It checks every ``nvme_path`` up front
(exists, writable, enough free space for what all ranks on this machine will write there).
It is the units' ``shard.storage.StatePlacement``: as each unit is built it decides where the
unit's fp32 master, stage-3 parameter shard and (stages 2-3) gradient slice live, and gives
those that go to swap files a ``SwappedSlot`` (so that building a large model never holds
more than one unit's values). It builds the offloaded optimizer over the units' pieces,
reports where memory is, and removes its files on ``close()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from zerotrain.comm.agreement import failed_ranks, filesystem_needs
from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import OffloadPolicy, PrecisionPolicy
from zerotrain.offload.aio import AsyncFileIO
from zerotrain.offload.optimizer import OffloadedAdam, Operand, PieceOperands
from zerotrain.offload.swap import SwapDirectory, SwapError, SwapFile, check_nvme_path
from zerotrain.offload.swapped import SwappedSlot, SwappedTensor, WriteBehind
from zerotrain.optim.factory import FlatGroup
from zerotrain.shard.storage import ResidentSlot, SlotStorage
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import (
    LargeAllocationMapping,
    map_large_allocations,
    release_free_memory,
)

log = get_logger(__name__)

_OPTIMIZER_PATH = "zero_optimization.offload_optimizer.nvme_path"
_PARAM_PATH = "zero_optimization.offload_param.nvme_path"
_SLACK_BYTES = 64 << 20  # alignment of regions, padding of units
# Gradient slices written out behind the backward pass but not yet on disk: bounds the
# memory of a slow disk to this many units' slices.
_GRAD_WRITES_IN_FLIGHT = 2


class Offload:
    """Swap files and the offloaded optimizer of one rank.

    Args:
        policy: what is offloaded where.
        comm: collectives over the data-parallel group (the space check is collective).
        shard_parameters: stage 3 (parameter offload applies only there).
        persistence_threshold: stage-3 units smaller than this stay gathered (never swapped).
        shard_gradients: stages 2-3 keep only this rank's gradient slice, which NVMe
            optimizer offload then swaps out too (stage 1 keeps whole gradients resident).
    """

    def __init__(
        self,
        policy: OffloadPolicy,
        comm: Communicator,
        shard_parameters: bool,
        persistence_threshold: int,
        shard_gradients: bool = False,
    ) -> None:
        self.policy = policy
        self.comm = comm
        self.swap_params = shard_parameters and policy.param == "nvme"
        self.swap_optimizer = policy.optimizer == "nvme"
        # On an accelerator the gradient slices stay on it and the step copies them to the
        # host chunk by chunk; swap files hold host tensors only.
        self.swap_grads = self.swap_optimizer and shard_gradients and comm.device.type == "cpu"
        if self.swap_params and comm.device.type != "cpu":
            raise SwapError(
                f"offload_param.device 'nvme' is supported on CPU runs only so far; this run "
                f"trains on {comm.device.type}, where parameter shards stay on the device. "
                "Use offload_optimizer (cpu or nvme) alone, or set offload_param.device to none"
            )
        self.persistence_threshold = persistence_threshold
        self.io: AsyncFileIO | None = None
        self._dirs: dict[Path, SwapDirectory] = {}
        self.optimizer_file: SwapFile | None = None
        self.param_file: SwapFile | None = None
        self.grad_file: SwapFile | None = None
        self.grad_writes = WriteBehind(_GRAD_WRITES_IN_FLIGHT)
        self._kept_in_cpu = 0  # parameter elements kept resident under max_in_cpu
        self.optimizer: OffloadedAdam | None = None
        # Swapped tensors are freed and regrown every step: without mapping them
        # individually, glibc keeps the freed blocks and resident memory grows with the
        # model. Held until close().
        self._mapping: LargeAllocationMapping | None = None
        if self.swap_optimizer or self.swap_params:
            self._mapping = map_large_allocations()
            if self._mapping.active:
                release_free_memory()
                log.info("NVMe offload: allocations of 1 MiB and more are mapped and unmapped")
        if comm.device.type != "cpu" and shard_parameters and policy.param == "cpu":
            log.warning(
                "offload_param.device 'cpu' does not move stage-3 parameter shards off %s yet: "
                "they stay in device memory (offload_optimizer still applies)",
                comm.device.type,
            )
        if comm.device.type == "cpu" and "cpu" in (policy.optimizer, policy.param):
            log.info(
                "offload to cpu on a CPU-only run: states already live in host memory; the "
                "optimizer step runs chunk by chunk"
            )

    # -- set-up ---------------------------------------------------------------------------------

    def reserve_for(
        self,
        trainable: Sequence[torch.Tensor],
        every: Sequence[torch.Tensor] | None,
        precision: PrecisionPolicy,
    ) -> None:
        """``reserve`` sized from the model, before any unit is built: ``trainable`` the
        parameters the optimizer steps; ``every``: at stage 3, all of the model's (its
        slices cover frozen parameters too), None at stages 0-2 (units hold only trainable
        ones, in fp32 master sizes)."""
        world = self.comm.world_size
        trainable_numel = sum(p.numel() for p in trainable)
        every_numel, itemsize = trainable_numel, 4
        model_dtype = trainable[0].dtype if trainable else torch.float32
        if every is not None:
            every_numel = sum(p.numel() for p in every)
            model_dtype = every[0].dtype if every else model_dtype
            itemsize = (precision.compute or model_dtype).itemsize
        grad_dtype = precision.resolve(model_dtype)[1]
        owned = -(-every_numel // world)
        self.reserve(
            owned,
            -(-trainable_numel // world),
            precision,
            itemsize,
            grad_bytes=owned * grad_dtype.itemsize,
        )

    def reserve(
        self,
        owned_numel: int,
        trainable_owned_numel: int,
        precision: PrecisionPolicy,
        compute_itemsize: int,
        grad_bytes: int = 0,
    ) -> None:
        """Check the NVMe paths and open the swap files (collective).

        ``owned_numel``: parameter elements this rank keeps (stage 3: its shards);
        ``trainable_owned_numel``: of them, those the optimizer steps; ``grad_bytes``: of
        this rank's gradient slices (swapped at stages 2-3).
        """
        # (swap file, its directory, the config key naming it, bytes it will hold)
        wanted: list[tuple[str, Path, str, int]] = []
        if self.swap_optimizer:
            per_element = 8 + (4 if precision.master_weights else 0)
            root = self._root(self.policy.optimizer_nvme_path, _OPTIMIZER_PATH)
            wanted.append(("optimizer", root, _OPTIMIZER_PATH, trainable_owned_numel * per_element))
            if self.swap_grads:
                wanted.append(("grads", root, _OPTIMIZER_PATH, grad_bytes))
        if self.swap_params:
            root = self._root(self.policy.param_nvme_path, _PARAM_PATH)
            wanted.append(("params", root, _PARAM_PATH, owned_numel * compute_itemsize))
        needs: dict[Path, int] = {}
        keys: dict[Path, str] = {}
        for _, root, key, nbytes in wanted:
            needs[root] = needs.get(root, 0) + nbytes
            keys.setdefault(root, key)
        self._check_space(needs, keys)
        if not wanted:
            return
        self.io = AsyncFileIO(self.policy.io_threads, self.policy.io_block_bytes)
        for root in needs:
            self._dirs[root] = SwapDirectory(root, self.comm.rank, self.io)
        files = {name: self._dirs[root].file(name) for name, root, _, _ in wanted}
        self.optimizer_file = files.get("optimizer")
        self.param_file = files.get("params")
        self.grad_file = files.get("grads")
        log.info(
            "NVMe offload: swap files under %s",
            ", ".join(str(d.path) for d in self._dirs.values()),
        )

    @staticmethod
    def _root(path: str | None, what: str) -> Path:
        if path is None:
            raise SwapError(f"{what} is not set")
        return Path(path).expanduser().resolve()

    def _check_space(self, needs: dict[Path, int], what: dict[Path, str]) -> None:
        """Every rank checks its paths against what all ranks sharing the filesystem need;
        if any rank's check fails, every rank raises (none is left waiting)."""
        problem = ""
        for root, (shared, _) in filesystem_needs(self.comm, needs).items():
            try:
                check_nvme_path(root, shared + _SLACK_BYTES, what[root])
            except SwapError as error:
                problem = str(error)
                break
        failed = failed_ranks(self.comm, bool(problem))
        if problem:
            raise SwapError(problem)
        if failed:
            raise SwapError(
                f"rank(s) {failed} found their offload nvme_path unusable (see their errors)"
            )

    @property
    def param_read_ahead(self) -> int:
        """Stage-3 units whose swapped shards are read back ahead of the prefetched ones
        (0 when shards stay in memory)."""
        return self.policy.param_buffer_count - 1 if self.swap_params else 0

    # -- where each unit's states live (shard.storage.StatePlacement) ---------------------------

    def master(self, tensor: torch.Tensor) -> SlotStorage:
        """The fp32 master slice of a unit being built: in the optimizer's swap file under
        NVMe optimizer offload (its values written there and freed), else in memory."""
        if self.optimizer_file is None or tensor.numel() == 0:
            return ResidentSlot(tensor)
        region = self.optimizer_file.allocate(tensor.numel(), torch.float32)
        return SwappedSlot(SwappedTensor(tensor, region))

    def grad_slice(self, tensor: torch.Tensor) -> SlotStorage:
        """A unit's gradient slice (stages 2-3): in the gradient swap file on CPU runs with
        NVMe optimizer offload, written behind each reduction, else in memory."""
        if self.grad_file is None or tensor.numel() == 0:
            return ResidentSlot(tensor)
        region = self.grad_file.allocate(tensor.numel(), tensor.dtype)
        # Zeros need no writing: a fresh region reads back as zeros.
        return SwappedSlot(SwappedTensor(tensor, region, store=False), self.grad_writes)

    def param_shard(self, tensor: torch.Tensor, unit_numel: int) -> SlotStorage:
        """A stage-3 unit's parameter shard: in the parameter swap file under NVMe
        parameter offload, except for units that stay gathered (below the persistence
        threshold) and the first ``max_in_cpu`` elements, which stay in memory."""
        if self.param_file is None:
            return ResidentSlot(tensor)
        if unit_numel < self.persistence_threshold or tensor.numel() == 0:
            return ResidentSlot(tensor)  # stays gathered for the whole run
        if self._kept_in_cpu + tensor.numel() <= self.policy.max_in_cpu:
            self._kept_in_cpu += tensor.numel()
            return ResidentSlot(tensor)
        region = self.param_file.allocate(tensor.numel(), tensor.dtype)
        return SwappedSlot(SwappedTensor(tensor, region))

    # -- optimizer ------------------------------------------------------------------------------

    def build_optimizer(
        self, hyper: dict[str, Any], groups: Sequence[FlatGroup], units: Sequence[ShardedUnit]
    ) -> OffloadedAdam:
        """The offloaded Adam over ``groups`` (flat groups of the units' pieces)."""
        operands: dict[int, PieceOperands] = {}
        owner: dict[int, ShardedUnit] = {}
        for unit in units:
            for piece in unit.pieces:
                operands[id(piece.param)] = _piece_operands(unit, piece.start, piece.param)
                owner[id(piece.param)] = unit

        def off_device_grad(piece: torch.Tensor) -> torch.Tensor | None:
            unit = owner.get(id(piece))
            return None if unit is None else unit.off_device_grads.get(id(piece))

        params = []
        for group in groups:
            for tensor in group.tensors:
                operands.setdefault(id(tensor), PieceOperands(Operand(tensor=tensor)))
            params.append({"params": group.tensors, **group.options})
        self.optimizer = OffloadedAdam(
            params,
            operands,
            self.optimizer_file,
            buffer_count=self.policy.optimizer_buffer_count,
            chunk_numel=self.policy.chunk_numel,
            pin_memory=self.policy.pin_memory,
            off_device_grad=off_device_grad,
            **hyper,
        )
        return self.optimizer

    # -- reporting and shutdown -----------------------------------------------------------------

    def settle(self) -> None:
        """Finish writing gradient slices (before the step reads them)."""
        self.grad_writes.flush()

    def nvme_bytes(self) -> int:
        """Bytes allocated in this rank's swap files."""
        return sum(d.disk_bytes for d in self._dirs.values())

    def buffer_bytes(self) -> int:
        """Bytes of the offloaded step's chunk buffers."""
        return 0 if self.optimizer is None else self.optimizer.buffer_bytes

    def io_seconds(self) -> float:
        """Seconds the training loop waited for the disk so far."""
        return 0.0 if self.optimizer is None else self.optimizer.io_wait_seconds

    @contextlib.contextmanager
    def resident(self, units: Sequence[ShardedUnit], write_back: bool) -> Iterator[None]:
        """Everything swapped out in memory for the duration (checkpoints)."""
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(unit.resident(write_back))
            if self.optimizer is not None:
                stack.enter_context(self.optimizer.resident_states(write_back))
            yield

    def close(self) -> None:
        """Remove the swap files and release the allocator setting (idempotent)."""
        self.grad_writes.flush()
        for directory in self._dirs.values():
            directory.close()
        self._dirs.clear()
        if self.io is not None:
            self.io.close()
            self.io = None
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None


def _swapped(slot: SlotStorage | None) -> SwappedTensor | None:
    """The swapped tensor behind ``slot`` when this module put it in a swap file."""
    return slot.swapped if isinstance(slot, SwappedSlot) else None


def _piece_operands(unit: ShardedUnit, start: int, param: torch.Tensor) -> PieceOperands:
    """Where the weights (and, for a swapped master, the copy to publish) of the piece at
    ``start`` of ``unit``'s flat buffer live."""
    n = param.numel()
    shard_swap = _swapped(unit.param_slot)
    lo = unit.owned[0]
    shard_op = (
        Operand(region=shard_swap.region, start=start - lo, cache=shard_swap)
        if shard_swap is not None
        else Operand(tensor=unit.buffer.owned_slice(start, start + n))
    )
    grad = None
    grad_swap = _swapped(unit.grad_slot)
    if grad_swap is not None:
        # Never cached: the step runs after every slice was written out and dropped.
        grad = Operand(region=grad_swap.region, start=start - lo)
    if unit.master is None:
        return PieceOperands(weights=shard_op, grad=grad)
    master = _swapped(unit.master_slot)
    if master is None:
        # unit.publish() rounds it
        return PieceOperands(weights=Operand(tensor=param), grad=grad)
    mlo = unit.master_range[0]
    weights = Operand(region=master.region, start=start - mlo, cache=master)
    return PieceOperands(weights=weights, publish=shard_op, grad=grad)

"""The offloaded optimizer step: Adam over this rank's pieces, one bounded chunk at a time.

Each piece (an optimizer group's part of a unit's owned range, see ``shard/unit.py``) has
three fp32 operands, the weights Adam updates and the two moments, plus optionally a copy
of the weights in the compute dtype to refresh. Each operand is either resident (a CPU
tensor: ``offload_optimizer.device = cpu``) or lives in a swap file (``nvme``; weights too
when stage-3 parameter shards or the fp32 master are swapped out). The step walks the
pieces in chunks of ``chunk_numel`` elements through ``buffer_count`` buffer sets: while
one chunk is updated, the next ones are being read and the previous one written, so disk
and compute overlap and resident memory is ``buffer_count`` chunks whatever the model size.

The update is ``optim.cpu_adam.adam_step_``, bitwise equal to ``optim.adam.Adam`` on the
same values, so an offloaded run reproduces a resident one exactly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotrain.offload.aio import IOFuture
from zerotrain.offload.swap import SwapFile, SwapRegion, aligned_empty
from zerotrain.offload.swapped import SwappedTensor
from zerotrain.optim.adam import adam_defaults
from zerotrain.optim.cpu_adam import CHUNK_ALIGN, AdamHyper, adam_step_
from zerotrain.shard.unit import take_changes
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_SUPPORTED = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad"}


@dataclass
class Operand:
    """Where one operand of a piece lives.

    Resident: ``tensor`` (the piece's own view). Swapped: elements ``[start, start + n)`` of
    ``region``; when ``cache`` (the swapped tensor the region backs) is resident at step
    time, its view ``tensor`` is updated in place and written through to the file.
    """

    tensor: torch.Tensor | None = None
    region: SwapRegion | None = None
    start: int = 0
    cache: SwappedTensor | None = None

    @property
    def swapped(self) -> bool:
        return self.region is not None and (self.cache is None or not self.cache.resident)


@dataclass
class PieceOperands:
    """The operands of one piece. ``publish``: the compute-dtype copy refreshed from the
    updated weights (only where the weights are a swapped-out master); ``grad``: the
    gradient when it lives in a swap file (else the piece's ``.grad``)."""

    weights: Operand
    publish: Operand | None = None
    grad: Operand | None = None
    exp_avg: Operand = field(default_factory=Operand)
    exp_avg_sq: Operand = field(default_factory=Operand)


@dataclass
class _Chunk:
    param: torch.Tensor
    ops: PieceOperands
    lo: int
    hi: int
    step: int
    hyper: AdamHyper
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    reads: list[IOFuture] = field(default_factory=list)


class _BufferSet:
    """Staging memory for the swapped operands of one chunk."""

    def __init__(self, chunk_numel: int, pin: bool) -> None:
        self.chunk_numel = chunk_numel
        self.pin = pin
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.writes: list[IOFuture] = []

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._buffers:
            self._buffers[key] = aligned_empty(self.chunk_numel, dtype, pin=self.pin)
        return self._buffers[key][:n]

    def drain(self) -> None:
        writes, self.writes = self.writes, []
        for write in writes:
            write.wait()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class OffloadedAdam(torch.optim.Optimizer):
    """Adam/AdamW over flat pieces whose states live on CPU or in swap files.

    Args:
        params: param groups over the pieces' tensors (as for ``optim.adam.Adam``).
        operands: for each piece tensor (by ``id``), where its operands live; moments of a
            piece without swapped moments are ordinary resident state.
        moment_file: the swap file for moments (None: moments stay resident).
        buffer_count: chunk buffer sets (reads ahead ``buffer_count - 2`` chunks).
        chunk_numel: elements per chunk.
        pin_memory: page-locked staging buffers.
        off_device_grad: a piece's gradient kept on an accelerator (torch allows no
            ``.grad`` on another device than the host piece's); None: ``.grad`` only.
    """

    swaps_states: bool

    def __init__(
        self,
        params: Sequence[dict[str, Any]],
        operands: dict[int, PieceOperands],
        moment_file: SwapFile | None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        amsgrad: bool = False,
        buffer_count: int = 4,
        chunk_numel: int = 1 << 22,
        pin_memory: bool = False,
        off_device_grad: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        defaults = adam_defaults(
            lr, betas, eps, weight_decay, bias_correction, adam_w_mode, amsgrad
        )
        super().__init__(list(params), defaults)
        for group in self.param_groups:
            _check_group(group)
        self._operands = operands
        self._off_device_grad = off_device_grad
        self._moment_file = moment_file
        self.swaps_states = moment_file is not None or any(
            o.weights.region is not None for o in operands.values()
        )
        # Read by the ZeRO step: states streamed through it cannot skip a parameter.
        self.steps_unused_because = (
            "NVMe offload streams the optimizer states through the step"
            if self.swaps_states
            else None
        )
        self._sets = [_BufferSet(chunk_numel, pin_memory) for _ in range(max(2, buffer_count))]
        self.chunk_numel = chunk_numel
        self.io_wait_seconds = 0.0  # total, for the wall-clock breakdown
        # Unscaling and clipping factor for gradients read from swap files (resident ones
        # are scaled in place before the step); set before each step, None: leave them.
        self.grad_scale: torch.Tensor | None = None
        for group in self.param_groups:
            for param in group["params"]:
                self._prepare(param)

    # -- states ---------------------------------------------------------------------------------

    def _prepare(self, param: torch.Tensor) -> None:
        ops = self._operands[id(param)]
        n = param.numel()
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        for name in ("exp_avg", "exp_avg_sq"):
            if self._moment_file is not None and n > 0:
                # A fresh region reads back as zeros: nothing to write.
                setattr(ops, name, Operand(region=self._moment_file.allocate(n, torch.float32)))
            else:
                value = torch.zeros(n, dtype=torch.float32)
                state[name] = value
                setattr(ops, name, Operand(tensor=value))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the chunk buffers (the resident cost of streaming)."""
        return sum(s.nbytes for s in self._sets)

    @contextlib.contextmanager
    def resident_states(self, write_back: bool) -> Iterator[None]:
        """Make swapped moments ordinary state tensors for the duration (checkpoints read
        and replace ``optimizer.state``); ``write_back``: store what is there afterwards."""
        swapped = [
            (p, ops)
            for g in self.param_groups
            for p in g["params"]
            if (ops := self._operands[id(p)]).exp_avg.region is not None
        ]
        for param, ops in swapped:
            for name in ("exp_avg", "exp_avg_sq"):
                op = getattr(ops, name)
                value = torch.empty(param.numel(), dtype=torch.float32)
                op.region.read(value, op.start).wait()
                self.state[param][name] = value.view(param.shape)
        try:
            yield
        finally:
            for param, ops in swapped:
                state = self.state[param]
                for name in ("exp_avg", "exp_avg_sq"):
                    value = state.pop(name, None)
                    op = getattr(ops, name)
                    if write_back:
                        if value is None:  # a checkpoint without moments: start from zero
                            value = torch.zeros(param.numel(), dtype=torch.float32)
                        op.region.write(value.reshape(-1).contiguous(), op.start).wait()
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every piece that has a gradient, chunk by chunk."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = list(self._chunks())
        ahead = max(1, len(self._sets) - 2)
        started = 0
        for j, chunk in enumerate(chunks):
            while started < len(chunks) and started <= j + ahead:
                self._start_reads(chunks[started], self._sets[started % len(self._sets)])
                started += 1
            waited = time.perf_counter()
            for read in chunk.reads:
                read.wait()
            self.io_wait_seconds += time.perf_counter() - waited
            self._update(chunk, self._sets[j % len(self._sets)])
        waited = time.perf_counter()
        for buffers in self._sets:
            buffers.drain()
        self.io_wait_seconds += time.perf_counter() - waited
        return loss

    def _chunks(self) -> Iterator[_Chunk]:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = AdamHyper(
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"],
            )
            for param in group["params"]:
                ops = self._operands[id(param)]
                if param.numel() == 0 or (self._grad(param) is None and ops.grad is None):
                    continue
                state = self.state[param]
                if "step" not in state:  # a checkpoint without optimizer states was loaded
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["step"] += 1
                step = int(state["step"].item())
                for name in ("exp_avg", "exp_avg_sq"):
                    op = getattr(ops, name)
                    if op.region is None:
                        # Resident moments are looked up each step: loading a checkpoint
                        # (or restoring an unused piece) replaces the state's tensors.
                        if name not in state:
                            state[name] = torch.zeros(param.numel(), dtype=torch.float32)
                        op.tensor = state[name].view(-1)
                # Chunk boundaries on the kernel's vector grid keep the update bitwise
                # equal to one call over the whole piece.
                size = max(CHUNK_ALIGN, self.chunk_numel // CHUNK_ALIGN * CHUNK_ALIGN)
                for lo in range(0, param.numel(), size):
                    hi = min(param.numel(), lo + size)
                    yield _Chunk(param, ops, lo, hi, step, hyper)

    def _operand_view(
        self, chunk: _Chunk, name: str, op: Operand, dtype: torch.dtype, buffers: _BufferSet
    ) -> torch.Tensor:
        """The chunk's elements of ``op``: a view of resident memory, or a staging buffer
        being filled from the file."""
        lo, hi = chunk.lo, chunk.hi
        if not op.swapped:
            return self._resident(op)[lo:hi]
        view = buffers.get(name, hi - lo, dtype)
        assert op.region is not None
        chunk.reads.append(op.region.read(view, op.start + lo))
        return view

    def _start_reads(self, chunk: _Chunk, buffers: _BufferSet) -> None:
        waited = time.perf_counter()
        buffers.drain()  # the set's previous chunk must be on disk before it is refilled
        self.io_wait_seconds += time.perf_counter() - waited
        ops = chunk.ops
        f32 = torch.float32
        chunk.views["weights"] = self._operand_view(chunk, "weights", ops.weights, f32, buffers)
        chunk.views["exp_avg"] = self._operand_view(chunk, "exp_avg", ops.exp_avg, f32, buffers)
        chunk.views["exp_avg_sq"] = self._operand_view(
            chunk, "exp_avg_sq", ops.exp_avg_sq, f32, buffers
        )
        if ops.publish is not None:
            if ops.publish.swapped:
                # Written, never read: the update fills it.
                dtype = ops.publish.region.dtype  # type: ignore[union-attr]
                chunk.views["publish"] = buffers.get("publish", chunk.hi - chunk.lo, dtype)
            else:
                chunk.views["publish"] = self._resident(ops.publish)[chunk.lo : chunk.hi]
        if ops.grad is not None:
            assert ops.grad.region is not None
            dtype = ops.grad.region.dtype
            chunk.views["grad"] = self._operand_view(chunk, "grad", ops.grad, dtype, buffers)
            return
        grad = self._grad(chunk.param)
        assert grad is not None
        grad = grad.reshape(-1)[chunk.lo : chunk.hi]
        if grad.device.type != "cpu":
            staged = buffers.get("grad", chunk.hi - chunk.lo, torch.float32)
            staged.copy_(grad, non_blocking=buffers.pin)
            grad = staged
        chunk.views["grad"] = grad

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The piece's gradient: its ``.grad``, else the one kept on the accelerator."""
        if param.grad is not None or self._off_device_grad is None:
            return param.grad
        return self._off_device_grad(param)

    @staticmethod
    def _resident(op: Operand) -> torch.Tensor:
        if op.cache is not None:
            return op.cache.tensor[op.start :]
        assert op.tensor is not None
        return op.tensor

    def _update(self, chunk: _Chunk, buffers: _BufferSet) -> None:
        views = chunk.views
        grad = self._grad(chunk.param)
        if grad is not None and grad.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the staged copy has landed
        if chunk.ops.grad is not None:
            streamed = views["grad"]
            if streamed.dtype != torch.float32:
                wide = buffers.get("grad_fp32", chunk.hi - chunk.lo, torch.float32)
                streamed = views["grad"] = wide.copy_(streamed)
            if self.grad_scale is not None:
                streamed.mul_(self.grad_scale)
        publish = views.get("publish")
        if publish is not None and not chunk.ops.publish.swapped:  # type: ignore[union-attr]
            # A swapped-out master cannot be compared before the step (unit.py leaves it to
            # this loop): parameter values changed outside the optimizer since the last
            # step (load_state_dict, a clamp) are taken into it here, chunk by chunk.
            take_changes(views["weights"], publish)
        adam_step_(
            views["weights"],
            views["grad"],
            views["exp_avg"],
            views["exp_avg_sq"],
            chunk.step,
            chunk.hyper,
            lowp_out=publish if publish is not None and publish.device.type == "cpu" else None,
        )
        if publish is not None and publish.device.type != "cpu":
            publish.copy_(views["weights"], non_blocking=buffers.pin)
        ops = chunk.ops
        for name, op in (
            ("weights", ops.weights),
            ("exp_avg", ops.exp_avg),
            ("exp_avg_sq", ops.exp_avg_sq),
            ("publish", ops.publish),
        ):
            if op is None or op.region is None:
                continue
            # Swapped operands go back to disk; resident caches of swapped tensors are
            # written through so the file stays the source of truth.
            buffers.writes.append(op.region.write(views[name], op.start + chunk.lo))
        chunk.views = {}
        chunk.reads = []


def _check_group(group: dict[str, Any]) -> None:
    unknown = sorted(set(group) - _SUPPORTED - {"params"})
    if not group["bias_correction"] or group["amsgrad"]:
        raise ValueError(
            "the offloaded optimizer step runs Adam/AdamW with bias_correction=true and "
            "amsgrad=false; this config sets "
            f"bias_correction={group['bias_correction']}, amsgrad={group['amsgrad']}"
        )
    invariant(not unknown or all(k in ("name",) for k in unknown), f"unknown options {unknown}")

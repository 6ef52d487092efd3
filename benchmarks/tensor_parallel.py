"""Tensor parallelism on one host: zerotrain's TP=2 against PyTorch's ``parallelize_module``.

Two ranks on this machine (gloo), tensor parallelism of degree 2 and nothing else (data
parallelism 1), the demo GPT (tied embedding and head), the same initial weights, the same
batches, AdamW with the same settings and the same gradient clipping. Systems:

- ``zt-tp2``: ``zerotrain.initialize(config={"tensor_parallel": {"autotp_size": 2}, ...})``,
  which splits the model with its own ``GPT._tp_plan``: vocabulary-parallel token embedding
  and tied head with zerotrain's vocabulary-parallel cross-entropy, packed ``[q; k; v]``
  (``packed_colwise:3``) and the MLP's first layer by columns, both output projections by
  rows; position embedding and LayerNorms whole. ZeRO stage 0 (nothing to shard with one
  data-parallel rank), ``engine(x, y)`` / ``engine.backward`` / ``engine.step``. Its
  collectives go through zerotrain's shared-memory arena (its default on one host).
- ``zt-tp2-gloo``: the same with ``ZEROTRAIN_SHM=0`` while the engine is built, so its
  collectives go over gloo as PyTorch's do (plus zerotrain's signature check, a small
  gloo all-reduce before each collective, its default on gloo);
- ``zt-tp2-gloo-nocheck``: also ``ZEROTRAIN_VERIFY_COLLECTIVES=0`` (no signature check):
  the same transport and the same collectives as PyTorch's.
- ``torch-tp2``: the same ``GPT`` split with ``torch.distributed.tensor.parallel.
  parallelize_module`` on a 1-D ``DeviceMesh`` of the 2 ranks: ``wte``
  ``RowwiseParallel`` (an ``nn.Embedding``: rows = vocabulary, output all-reduced to
  replicated), ``lm_head`` ``ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)`` tied back to ``wte``'s ``DTensor`` weight (both ``Shard(0)``),
  the loss under ``loss_parallel()`` (PyTorch's vocabulary-parallel cross-entropy), qkv and
  ``mlp.fc`` ``ColwiseParallel``, ``attn.proj`` and ``mlp.proj`` ``RowwiseParallel``;
  position embedding and LayerNorms stay plain tensors. ``ColwiseParallel`` cuts an output
  into contiguous row blocks, which for the packed ``[q; k; v]`` would give rank 0 all of q
  and half of k; so the rows of every qkv weight and bias are permuted first into
  ``[q_0; k_0; v_0; q_1; k_1; v_1]`` (``q_r``: rank r's heads), and rank r's contiguous
  block is then exactly the ``[q_r; k_r; v_r]`` that zerotrain's packed split gives it (the
  same values, one fused matmul; checked before timing: every local weight equals
  zerotrain's). ``torch.optim.AdamW(fused=True)`` over two parameter groups (the
  ``DTensor`` parameters, the plain ones: fused/foreach kernels refuse a mix); clipping
  with ``torch.nn.utils.get_total_norm`` per group (the ``DTensor`` norm made whole with
  ``full_tensor()``) and ``clip_grads_with_norm_``; ``zero_grad()`` (gradients set to
  None). Gradients need no other handling with TP only: the replicated parameters get the
  same gradients on both ranks.

Before timing, one job checks that every system's losses match a single-process run of the
same model (plain PyTorch, ``torch.optim.AdamW``, ``clip_grad_norm_``) within ``--tol``
over ``--check-steps`` steps, and that zerotrain's and PyTorch's local weights are equal.

Time: ``--repeats`` jobs (2 processes each) holding all systems, which take turns step by
step in a rotating order; each step starts after a barrier and its time is the slower
rank's. "step ms": median over repeats of each job's median step. "time / X": paired, the
median over every measured round of (system's step time / X's) in the same round (<1:
faster than X). Time by phase: the same steps, with a clock read around the forward, the
backward and clip + optimizer step (zerotrain: ``engine(x, y)``, ``engine.backward``,
``engine.step``), median over steps of the slower rank's.

Memory: one job per system, alone in its processes, glibc mapping every allocation
>= 64 KiB on its own (so frees leave the resident set), measured over ``--steps`` steps
after ``--warmup`` steps: "RSS growth in steps" = the resident high-water mark during the
measured steps minus the resident size before them, and "peak RSS in steps" that mark
(``PeakRSSMeter``: ``/proc/self/clear_refs`` then ``VmHWM``); "lifetime peak RSS" = the
larger of that and ``VmHWM`` before the steps (start-up, building and splitting the model,
warm-up); "saved for backward" = the peak bytes of the storages autograd holds for
backward (``saved_tensors_hooks``; a storage counts once, ``DTensor``s by their local
tensor, parameters excluded); "model states" = this rank's parameters + gradients +
optimizer states after the last step (zerotrain: ``memory_breakdown()``; PyTorch: the
local tensors).

Communication, one more job, one step per system after a warm-up step, on each rank, in
the ZeRO paper's volume model that ``zerotrain.comm.stats`` uses (an all-reduce of S bytes
counts 2S; an all-gather or reduce-scatter of a full tensor of S bytes counts S; the
payload S is shown too), by phase (forward, backward, clip + optimizer step):

- zerotrain: ``engine.comm_stats()``'s counters (the sum over ``engine.groups.distinct()``),
  read before and after each phase and kept apart by communicator size: the 2-rank tensor
  group (data moved between the ranks) and the 1-rank groups (the data group etc.: calls
  counted, nothing moved; a ``LocalCommunicator`` copies locally at most). Its gloo
  signature checks are not in these counters.
- every system: a ``CommDebugMode`` (``torch.distributed.tensor.debug``) around each phase.
  It counts collective calls only; subclassed here to record each call's op and tensor
  bytes. It sees what goes through PyTorch's dispatcher: DTensor's functional collectives
  and ``torch.distributed`` calls on gloo (so zerotrain's gloo collectives and signature
  checks too, its shared-memory arena not at all): a cross-check of zerotrain's counters.

    OMP_NUM_THREADS=1 python benchmarks/tensor_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("zt-tp2", "torch-tp2", "zt-tp2-gloo", "zt-tp2-gloo-nocheck")
BASELINE = "zt-tp2"
TP = 2
PHASES = ("forward", "backward", "step")


# -- the model and the data ---------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """The GPT trained, its batches and the optimizer."""

    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    block: int = 128
    batch: int = 8
    vocab: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0

    def gpt_config(self) -> Any:
        from zerotrain.examples.gpt import GPTConfig

        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.block,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def dense(self) -> Any:
        """The dense model, the same values on every rank and in every system."""
        from zerotrain.examples.gpt import GPT

        torch.manual_seed(self.seed)
        return GPT(self.gpt_config())

    def batch_of(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, self.vocab, (self.batch, self.block + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def describe(self) -> str:
        return (
            f"GPTConfig(n_layer={self.n_layer}, n_head={self.n_head}, n_embd={self.n_embd}, "
            f"block_size={self.block}, vocab_size={self.vocab}, tie_weights=True, bias=True, "
            f"dropout=0), batch {self.batch} x {self.block} tokens, AdamW(lr={self.lr:g}, "
            f"weight_decay={self.weight_decay:g}), gradient clipping "
            f"{self.clip:g}" + (" (off)" if not self.clip else "") + ", fp32"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


# -- communication counted from PyTorch's dispatcher ----------------------------------------


def _counting_mode() -> Any:
    """A ``CommDebugMode`` that also records each collective's op and tensor bytes."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    class CommBytesMode(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []  # (op in zerotrain's names, payload bytes)

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
                return out
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                self.calls.append(_payload(packet.__name__, args))
            return out

    return CommBytesMode()


def _tensor_bytes(arg: Any) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, list | tuple):
        return sum(_tensor_bytes(a) for a in arg)
    return 0


def _payload(name: str, args: tuple[Any, ...]) -> tuple[str, int]:
    """``(op, bytes of the full tensor)`` of one collective call, as zerotrain's counters
    name and size them (an all-gather's full tensor is its output, a reduce-scatter's its
    input)."""
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return "all_gather", _tensor_bytes(args[0]) * int(args[1])  # (input, group_size, ..)
    if name in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return "all_gather", _tensor_bytes(args[0])  # (output(s), input(s), ...)
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return "reduce_scatter", _tensor_bytes(args[0])  # (input(s), op, group_size, ..)
    if name.startswith(("reduce_scatter", "_reduce_scatter")):
        return "reduce_scatter", _tensor_bytes(args[1])  # (output(s), input(s), ...)
    if name.startswith(("all_reduce", "allreduce")):
        return "all_reduce", _tensor_bytes(args[0])
    if name.startswith("broadcast"):
        return "broadcast", _tensor_bytes(args[0])
    if "all_to_all" in name or "alltoall" in name:
        return "all_to_all", _tensor_bytes(args[0])
    return name, _tensor_bytes(args[0])


def _volume(calls: list[tuple[str, int]]) -> dict[str, Any]:
    from zerotrain.comm.stats import VOLUME_FACTOR

    by_op: dict[str, list[int]] = {}
    for op, payload in calls:
        entry = by_op.setdefault(op, [0, 0, 0])
        entry[0] += 1
        entry[1] += VOLUME_FACTOR.get(op, 1) * payload
        entry[2] += payload
    return {
        "calls": len(calls),
        "bytes": sum(e[1] for e in by_op.values()),
        "payload": sum(e[2] for e in by_op.values()),
        "by_op": {op: tuple(e) for op, e in sorted(by_op.items())},
    }


# -- the systems ------------------------------------------------------------------------------


@dataclass
class System:
    """One rank's side of a system. ``step(i, phase)`` trains batch ``i`` and returns the
    loss; ``phase(name)`` is entered around its forward, backward and clip + step."""

    step: Callable[[int, Callable[[str], Any]], float]
    state_bytes: Callable[[], int]
    params: list[nn.Parameter]
    local_weights: Callable[[], dict[str, torch.Tensor]]
    comm_counters: Callable[[], dict[int, Any]] | None = None  # zerotrain: by group size
    notes: dict[str, Any] = field(default_factory=dict)


def _no_phase(name: str) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def build_zt(spec: Spec, env: dict[str, str] | None = None) -> System:
    """zerotrain's engine; ``env``: environment variables set while it is built (its
    communicators read ``ZEROTRAIN_SHM`` and ``ZEROTRAIN_VERIFY_COLLECTIVES`` then)."""
    import zerotrain

    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec.lr, "weight_decay": spec.weight_decay},
        },
        "gradient_clipping": spec.clip,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": TP},
        "steps_per_print": 10**6,
    }
    before = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        engine, _, _, _ = zerotrain.initialize(model=spec.dense(), config=config)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if engine.groups.tensor.world_size != TP or engine.groups.data.world_size != 1:
        raise RuntimeError("expected a tensor group of 2 and no data parallelism")

    def step(i: int, phase: Callable[[str], Any]) -> float:
        x, y = spec.batch_of(i)
        with phase("forward"):
            loss = engine(x, y)
        with phase("backward"):
            engine.backward(loss)
        with phase("step"):
            engine.step()
        return float(loss.detach())

    def state() -> int:
        b = engine.memory_breakdown()
        return b.params + b.grads + b.master_weights + b.optimizer_states

    def local_weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    def counters() -> dict[int, Any]:
        """``engine.comm_stats()`` (the sum over ``engine.groups.distinct()``), kept apart
        by the communicator's size: the 1-rank groups' calls are counted but move nothing."""
        from zerotrain.comm.stats import CollectiveCount, CommSnapshot

        by_size: dict[int, dict[tuple[str, str], Any]] = {}
        for comm in engine.groups.distinct():
            counts = by_size.setdefault(comm.world_size, {})
            for key, count in comm.snapshot().counts.items():
                counts[key] = counts.get(key, CollectiveCount()) + count
        return {size: CommSnapshot(counts) for size, counts in sorted(by_size.items())}

    return System(
        step,
        state,
        list(engine.module.parameters()),
        local_weights,
        comm_counters=counters,
        notes={
            "shm": engine.groups.tensor._shm is not None,
            "verify": engine.groups.tensor._verify,
        },
    )


def _permute_packed_qkv(model: Any, degree: int) -> None:
    """Reorder the rows of every ``[q; k; v]`` weight and bias into ``[q_0; k_0; v_0; ...;
    q_{t-1}; k_{t-1}; v_{t-1}]``, so that a contiguous split in ``degree`` row blocks gives
    rank r its heads of q, k and v."""
    with torch.no_grad():
        for block in model.blocks:
            qkv = block.attn.qkv
            for p in (qkv.weight, qkv.bias):
                if p is None:
                    continue
                parts = [part.chunk(degree, dim=0) for part in p.chunk(3, dim=0)]
                p.copy_(torch.cat([parts[j][r] for r in range(degree) for j in range(3)], 0))


def build_torch(spec: Spec) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (TP,))
    model = spec.dense()
    _permute_packed_qkv(model, TP)
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for i in range(spec.n_layer):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # parallelize_module replaced each module's weight with a new DTensor parameter; tie
    # the head back to the embedding's (both Shard(0) along the vocabulary).
    model.lm_head.weight = model.wte.weight
    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": dtensors}, {"params": plain}]
    try:
        opt = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
        kind = "fused"
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay, foreach=True)
        kind = "foreach"

    def clip() -> None:
        norms = []
        for group in (dtensors, plain):
            grads = [p.grad for p in group if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for group in (dtensors, plain):
            torch.nn.utils.clip_grads_with_norm_(group, spec.clip, total, foreach=True)

    def step(i: int, phase: Callable[[str], Any]) -> float:
        x, y = spec.batch_of(i)
        opt.zero_grad()
        with loss_parallel():
            with phase("forward"):
                loss = model(x, y)
            with phase("backward"):
                loss.backward()
        with phase("step"):
            if spec.clip:
                clip()
            opt.step()
        return float(_local(loss.detach()))

    def state() -> int:
        total = 0
        for p in params:
            total += _nbytes(p)
            if p.grad is not None:
                total += _nbytes(p.grad)
        for s in opt.state.values():
            total += sum(_nbytes(v) for v in s.values() if torch.is_tensor(v))
        return total

    def local_weights() -> dict[str, torch.Tensor]:
        return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}

    return System(step, state, params, local_weights, notes={"optimizer": kind})


BUILDERS: dict[str, Callable[[Spec], System]] = {
    "zt-tp2": build_zt,
    "zt-tp2-gloo": lambda spec: build_zt(spec, {"ZEROTRAIN_SHM": "0"}),
    "zt-tp2-gloo-nocheck": lambda spec: build_zt(
        spec, {"ZEROTRAIN_SHM": "0", "ZEROTRAIN_VERIFY_COLLECTIVES": "0"}
    ),
    "torch-tp2": build_torch,
}


def reference_losses(spec: Spec, steps: int) -> list[float]:
    """One process, plain PyTorch, the dense model on the same batches."""
    model = spec.dense()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    losses = []
    for i in range(steps):
        x, y = spec.batch_of(i)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# -- jobs (run on every rank) -----------------------------------------------------------------


def _parity_job(systems: list[str], spec: Spec, steps: int) -> dict[str, Any]:
    """Each system's losses over ``steps`` steps, and the largest difference between
    zerotrain's and PyTorch's local weights before training."""
    built = {name: BUILDERS[name](spec) for name in systems}
    weights = {name: s.local_weights() for name, s in built.items()}
    weight_diff: dict[str, float] = {}
    if "torch-tp2" in weights:
        theirs = weights["torch-tp2"]
        for name in systems:
            if name == "torch-tp2":
                continue
            ours = weights[name]
            if set(ours) != set(theirs):
                raise RuntimeError(f"parameter names differ: {sorted(set(ours) ^ set(theirs))}")
            weight_diff[name] = max(
                (ours[n] - theirs[n]).abs().max().item() if ours[n].shape == theirs[n].shape
                else float("inf")
                for n in ours
            )  # fmt: skip
    losses = {name: [s.step(i, _no_phase) for i in range(steps)] for name, s in built.items()}
    return {"losses": losses, "weight_diff": weight_diff}


def _timing_job(
    systems: list[str], spec: Spec, warmup: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """All systems in this process, taking turns step by step (the order rotates every
    round); each step after a barrier. This rank's step times, the times of its phases
    (forward, backward, clip + step: two clock reads each) and losses by system."""
    built = {name: BUILDERS[name](spec) for name in systems}
    out: dict[str, dict[str, list[float]]] = {
        n: {"times": [], "losses": [], **{p: [] for p in PHASES}} for n in systems
    }
    for i in range(warmup + steps):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for name in order:
            phases: dict[str, float] = {}

            @contextlib.contextmanager
            def phase(which: str, phases: dict[str, float] = phases) -> Iterator[None]:
                start = time.perf_counter()
                yield
                phases[which] = time.perf_counter() - start

            dist.barrier()
            start = time.perf_counter()
            loss = built[name].step(i, phase)
            seconds = time.perf_counter() - start
            out[name]["losses"].append(loss)
            if i >= warmup:
                out[name]["times"].append(seconds)
                for which, took in phases.items():
                    out[name][which].append(took)
    return out


class _Saved:
    """What the pack hook hands autograd: the tensor, released when autograd drops it."""

    __slots__ = ("ptr", "tensor", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: LiveStorages) -> None:
        self.tensor, self.tracker = tensor, tracker
        self.ptr = tracker.acquire(tensor)

    def __del__(self) -> None:
        if self.ptr is not None:
            self.tracker.release(self.ptr)


class LiveStorages:
    """Bytes of the storages autograd holds for backward, and their peak: a storage counts
    once (by data pointer) from its first saved reference until the last one is released;
    storages in ``exclude`` (the parameters') never count. A ``DTensor`` counts by its
    local tensor."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, references]
        self.bytes = self.peak = 0

    def acquire(self, t: torch.Tensor) -> int | None:
        storage = _local(t).untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.exclude:
            return None
        entry = self.refs.get(ptr)
        if entry is None:
            self.refs[ptr] = [nbytes, 1]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1
        return ptr

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[ptr]
            self.bytes -= entry[0]

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: _Saved(t, self), lambda s: s.tensor
        ):
            yield


def _map_every_allocation() -> None:
    """glibc: serve allocations >= 64 KiB by mmap, so freed tensors leave the resident set."""
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold, m_trim_threshold = -3, -1
    libc.mallopt(m_mmap_threshold, 65536)
    libc.mallopt(m_trim_threshold, 65536)


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (kB) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _memory_job(system: str, spec: Spec, warmup: int, steps: int) -> dict[str, Any]:
    """``system`` alone in this process: ``warmup`` steps, then ``steps`` measured ones."""
    from zerotrain.utils.memory import PeakRSSMeter

    _map_every_allocation()
    sysm = BUILDERS[system](spec)
    for i in range(warmup):
        sysm.step(i, _no_phase)
    saved = LiveStorages({_local(p).untyped_storage().data_ptr() for p in sysm.params})
    before = _status_bytes("VmHWM")  # the meter resets the high-water mark: read it first
    with saved.tracking(), PeakRSSMeter() as meter:
        for i in range(warmup, warmup + steps):
            dist.barrier()
            sysm.step(i, _no_phase)
    return {
        "saved": saved.peak,
        "rss_growth": meter.increase_bytes,
        "peak_rss_steps": meter.peak_bytes,
        "peak_rss": max(before, meter.peak_bytes),
        "state": sysm.state_bytes(),
        "notes": sysm.notes,
    }


def _comm_job(systems: list[str], spec: Spec) -> dict[str, Any]:
    """Per system, this rank's collectives in one step (after a warm-up step), by phase:
    a ``CommDebugMode`` around each phase and, for zerotrain, its counters before and
    after each phase, split into the 2-rank tensor group and the 1-rank groups."""
    built = {name: BUILDERS[name](spec) for name in systems}
    out: dict[str, Any] = {}
    for name, sysm in built.items():
        sysm.step(0, _no_phase)
        counted: dict[str, dict[str, Any]] = {}

        @contextlib.contextmanager
        def phase(
            which: str, sysm: System = sysm, counted: dict[str, dict[str, Any]] = counted
        ) -> Iterator[None]:
            mode = _counting_mode()
            before = sysm.comm_counters() if sysm.comm_counters else None
            with mode:
                yield
            counted.setdefault("CommDebugMode", {})[which] = _volume(mode.calls)
            if before is not None and sysm.comm_counters is not None:
                after = sysm.comm_counters()
                for size, snapshot in after.items():
                    label = f"zerotrain, {size}-rank groups"
                    counted.setdefault(label, {})[which] = _zt_volume(before[size], snapshot)

        dist.barrier()
        sysm.step(1, phase)
        out[name] = counted
    return out


def _zt_volume(before: Any, after: Any) -> dict[str, Any]:
    """What two ``CommSnapshot``s differ by, by (op, purpose)."""
    found: dict[str, Any] = {"calls": 0, "bytes": 0, "payload": 0, "by_op": {}}
    for (op, purpose), count in sorted(after.counts.items()):
        old = before.counts.get((op, purpose))
        calls = count.calls - (old.calls if old else 0)
        if not calls:
            continue
        volume = count.bytes - (old.bytes if old else 0)
        payload = count.payload_bytes - (old.payload_bytes if old else 0)
        found["calls"] += calls
        found["bytes"] += volume
        found["payload"] += payload
        found["by_op"][f"{op} ({purpose})"] = (calls, volume, payload)
    return found


# -- the driver ---------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _kib(n: float) -> str:
    return f"{n / 2**10:,.1f}" if n >= 1024 or n == 0 else f"{n:.0f} B"


def _paired(rounds: dict[str, list[float]], system: str, reference: str) -> float:
    ours, base = rounds[system], rounds[reference]
    return statistics.median(a / b for a, b in zip(ours, base, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 warm-up, 2 steps")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per job")
    parser.add_argument("--check-steps", type=int, default=5)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clip", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="also write the raw measurements to this file")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2
    systems: list[str] = args.systems.split(",")
    if BASELINE not in systems:
        parser.error(f"--systems must include {BASELINE}")
    spec = Spec(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block=args.block,
        batch=args.batch,
        clip=args.clip,
    )
    from zerotrain.testing.dist import run_distributed

    def run(fn: Callable[..., Any], *fn_args: Any) -> list[Any]:
        return run_distributed(fn, TP, *fn_args, timeout=args.timeout)

    total_steps = args.warmup + args.steps
    torch.set_num_threads(1)
    reference = reference_losses(spec, max(total_steps, args.check_steps))

    # 1. the same training: losses against one process, local weights against each other
    parity = run(_parity_job, systems, spec, args.check_steps)
    problems = []
    for name in systems:
        for rank, result in enumerate(parity):
            diff = max(
                abs(a - b)
                for a, b in zip(result["losses"][name], reference, strict=False)
            )  # fmt: skip
            if diff > args.tol:
                problems.append(f"{name} rank {rank}: loss differs from one process by {diff:.2e}")
            wd = result["weight_diff"].get(name, 0.0)
            if wd > 0.0:
                problems.append(f"{name} rank {rank}: local weights differ from torch by {wd:.2e}")
    if problems:
        sys.exit("parity check failed: " + "; ".join(problems))
    print(f"[parity] {args.check_steps} steps within {args.tol:g} of one process", flush=True)

    # 2. time
    rounds: dict[str, list[float]] = {s: [] for s in systems}
    medians: dict[str, list[float]] = {s: [] for s in systems}
    losses: dict[str, list[list[float]]] = {s: [] for s in systems}
    phase_times: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in systems}
    for repeat in range(args.repeats):
        ranks = run(_timing_job, systems, spec, args.warmup, args.steps)
        for name in systems:
            per_step = [max(r[name]["times"][k] for r in ranks) for k in range(args.steps)]
            rounds[name].extend(per_step)
            medians[name].append(statistics.median(per_step))
            losses[name] += [r[name]["losses"] for r in ranks]
            for p in PHASES:
                phase_times[name][p] += [
                    max(r[name][p][k] for r in ranks) for k in range(args.steps)
                ]
        cells = ", ".join(f"{s} {1000 * medians[s][-1]:.1f}" for s in systems)
        print(f"[{repeat + 1}/{args.repeats}] ms/step: {cells}", flush=True)

    # 3. memory, 4. communication
    memory = {name: run(_memory_job, name, spec, args.warmup, args.steps) for name in systems}
    comm = run(_comm_job, systems, spec)

    report = _report(args, spec, systems, reference, rounds, medians, losses, memory, comm)
    report += [
        "",
        "Time by phase, ms: median over every measured step of the slower rank's time "
        "(so the phases need not add up to the step).",
        "",
        "| system | " + " | ".join(PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for name in systems:
        cells = " | ".join(f"{1000 * statistics.median(phase_times[name][p]):.1f}" for p in PHASES)
        report.append(f"| {name} | {cells} |")
    print("\n".join(report))
    if args.json:
        raw = {
            "spec": spec.__dict__,
            "reference": reference,
            "rounds": rounds,
            "medians": medians,
            "losses": losses,
            "phases": phase_times,
            "memory": memory,
            "comm": comm,
        }
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)


def _report(
    args: argparse.Namespace,
    spec: Spec,
    systems: list[str],
    reference: list[float],
    rounds: dict[str, list[float]],
    medians: dict[str, list[float]],
    losses: dict[str, list[list[float]]],
    memory: dict[str, list[dict[str, Any]]],
    comm: list[dict[str, Any]],
) -> list[str]:
    command = "OMP_NUM_THREADS=1 python benchmarks/tensor_parallel.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    n_params = sum(p.numel() for p in spec.dense().parameters())
    lines = [
        f"`{command}`",
        "",
        f"- {spec.describe()}; {n_params / 1e6:.2f}M parameters (tied head counted once)",
        f"- {args.repeats} repeats x {args.steps} measured steps (after {args.warmup} warm-up "
        f"steps); torch {torch.__version__}; optimizer of torch-tp2: "
        f"{memory.get('torch-tp2', [{'notes': {}}])[0]['notes'].get('optimizer', '-')}",
        "",
        "| system | step ms, median of repeats (range) | time / zt-tp2 (paired) "
        "| time / torch-tp2 (paired) "
        "| RSS growth in steps MiB (rank 0 / 1) | peak RSS in steps MiB (rank 0 / 1) "
        "| lifetime peak RSS MiB (rank 0 / 1) "
        "| saved for backward MiB (rank 0 / 1) | model states MiB (rank 0 / 1) "
        "| comm / step / rank: calls, KiB (paper volume; zerotrain: 2-rank group) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def vs_torch(name: str) -> str:
        return f"{_paired(rounds, name, 'torch-tp2'):.3f}" if "torch-tp2" in rounds else "-"

    for name in systems:
        runs = medians[name]
        mem = memory[name]

        def pair(key: str, mem: list[dict[str, Any]] = mem) -> str:
            return " / ".join(_mib(r[key]) for r in mem)

        entry = comm[0][name]
        counted = entry.get(f"zerotrain, {TP}-rank groups", entry["CommDebugMode"])
        calls = sum(counted[p]["calls"] for p in PHASES)
        volume = sum(counted[p]["bytes"] for p in PHASES)
        lines.append(
            f"| {name} | {1000 * statistics.median(runs):.1f} ({1000 * min(runs):.0f}-"
            f"{1000 * max(runs):.0f}) | {_paired(rounds, name, BASELINE):.3f} "
            f"| {vs_torch(name)} | {pair('rss_growth')} | {pair('peak_rss_steps')} "
            f"| {pair('peak_rss')} | {pair('saved')} | {pair('state')} "
            f"| {calls}, {_kib(volume)} |"
        )
    lines += [
        "",
        "Losses (rank 0, first repeat; every repeat and rank enter the maxima below):",
        "",
    ]
    steps = len(losses[systems[0]][0])
    lines.append("| step | one process | " + " | ".join(systems) + " |")
    lines.append("|---|---|" + "---|" * len(systems))
    for k in range(steps):
        cells = " | ".join(f"{losses[s][0][k]:.6f}" for s in systems)
        lines.append(f"| {k} | {reference[k]:.6f} | {cells} |")
    worst = {
        s: max(abs(run[k] - reference[k]) for run in losses[s] for k in range(steps))
        for s in systems
    }
    pairwise = (
        max(
            abs(a[k] - b[k])
            for a in losses["torch-tp2"]
            for b in losses[BASELINE]
            for k in range(steps)
        )
        if "torch-tp2" in systems
        else float("nan")
    )
    lines += [
        "",
        "Max |loss - one process| over every step, rank and repeat: "
        + ", ".join(f"{s} {worst[s]:.2e}" for s in systems)
        + f"; max |torch-tp2 - zt-tp2|: {pairwise:.2e}",
        "",
        "Communication per step on rank 0 (rank 1: "
        + ("the same" if comm[0] == comm[1] else "DIFFERENT, see the raw output")
        + "): calls, KiB in the paper's volume model (payload KiB), by phase. "
        "'zerotrain, 2-rank groups': the engine's counters of its tensor group; "
        "'zerotrain, 1-rank groups': its counters of the data group etc. (counted, nothing "
        "moved); 'CommDebugMode': collectives seen by PyTorch's dispatcher.",
        "",
        "| system | counter | forward | backward | clip + optimizer step "
        "| ops (count, payload KiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name in systems:
        for label, counted in sorted(comm[0][name].items(), reverse=True):
            cells = " | ".join(
                f"{counted[p]['calls']}, {_kib(counted[p]['bytes'])} "
                f"({_kib(counted[p]['payload'])})"
                for p in PHASES
            )
            ops = "; ".join(
                f"{p}: "
                + ", ".join(
                    f"{op} {c}x {_kib(pl)}" for op, (c, _, pl) in counted[p]["by_op"].items()
                )
                for p in PHASES
                if counted[p]["by_op"]
            )
            lines.append(f"| {name} | {label} | {cells} | {ops or '-'} |")
    return lines


if __name__ == "__main__":
    main()

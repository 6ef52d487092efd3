"""Per-rank bytes of the model states, category by category, as the engine would hold them.

The arithmetic follows the engine's own structures rather than the ZeRO paper's round
numbers, so that a prediction from real shapes matches ``engine.memory_breakdown()``:

* units are planned as ``zero/units.py`` plans them (buckets of trainable parameters at
  stages 0-2, blocks plus a root unit at stage 3) and padded as ``shard/layout.py`` pads
  them (to a multiple of the world size once states are partitioned);
* a rank owns ``[r * S, (r + 1) * S)`` of each padded unit; its fp32 master copy covers that
  range (padding included), its optimizer moments only the real trainable elements in it;
* every optimizer piece (one per unit and group this rank owns elements of) adds the
  optimizer's scalar step counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.comm.buckets import plan_buckets
from zerotrain.estimate.shapes import ModelShape, UnitShape
from zerotrain.zero.issue import batch_small_units, reduce_batch_numel
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.units import auto_bucket_numel

# Optimizer name -> (state elements per stepped element, bytes of per-piece scalars).
# Adam/AdamW/LAMB keep two moments; zerotrain's Adam adds a 0-d fp32 step tensor per piece
# (LAMB's step is a Python int). SGD's momentum buffer is one element per element.
OPTIMIZER_STATES = {
    "adam": (2, 4),
    "adamw": (2, 4),
    "lamb": (2, 0),
    "sgd": (1, 0),
    "none": (0, 0),
}


@dataclass(frozen=True, slots=True)
class ZeroSetup:
    """The configuration the bytes depend on (what ``initialize`` would receive).

    Attributes:
        stage / world_size / rank: ZeRO stage, data-parallel ranks, the rank reported.
        param_bytes: element size of the compute dtype (parameters as trained).
        grad_bytes: element size of the gradient accumulation dtype.
        comm_bytes: element size of the dtype gradients are reduced in (staging).
        master: fp32 master weights (bf16/fp16 training).
        optimizer: a key of :data:`OPTIMIZER_STATES`.
        device: "cuda" or "cpu" (the engine sizes buckets and overlap by it).
        bucket_numel: ``reduce_bucket_size`` (None: sized from the model, as the engine does).
        overlap: ``overlap_comm`` (None: on for cuda, off for cpu).
        prefetch_numel / persistence_threshold / max_live_numel: the ``stage3_*`` keys.
        max_in_cpu: ``offload_param.max_in_cpu`` (parameter shard elements kept in memory).
    """

    stage: int
    world_size: int
    rank: int
    param_bytes: int
    grad_bytes: int
    comm_bytes: int
    master: bool
    optimizer: str = "adam"
    device: str = "cuda"
    bucket_numel: int | None = None
    overlap: bool | None = None
    prefetch_numel: int = 50_000_000
    persistence_threshold: int = 100_000
    max_live_numel: int = 1_000_000_000
    max_in_cpu: int = 1_000_000_000

    @property
    def sharded(self) -> bool:
        """Whether optimizer states (and so unit layouts) are partitioned."""
        return self.stage >= 1

    @property
    def overlaps(self) -> bool:
        """``overlap_comm`` as the engine resolves it."""
        return self.overlap if self.overlap is not None else self.device == "cuda"


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes one rank holds per category (all on the training device, before offload)."""

    params: int
    grads: int
    master_weights: int
    optimizer_states: int
    buffers: int
    gathered: int
    staging: int
    units: int
    padding_elements: int
    stepped_elements: int
    # Stage 3: parameter bytes NVMe parameter offload would keep in memory (units below the
    # persistence threshold, and the first built that fit in ``max_in_cpu``).
    kept_params: int = 0


def _padded(numel: int, setup: ZeroSetup) -> int:
    chunk = setup.world_size if setup.sharded else 1
    return -(-numel // chunk) * chunk


def _plan_buckets(shape: ModelShape, setup: ZeroSetup) -> list[UnitShape]:
    """Stage 0-2 units as ``zero.units.build_units`` packs them (one dtype assumed)."""
    sizes = list(reversed(shape.trainable))  # gradients arrive last layer first
    total = sum(sizes) + sum(shape.isolated)
    zero = ZeroPolicy.for_stage(setup.stage)
    bucket = setup.bucket_numel
    if bucket is None:
        bucket = auto_bucket_numel(total, torch.device(setup.device), zero) if sizes else 0
    unit_numel = bucket // 2 if zero.shard_gradients and setup.overlaps else bucket
    units = []
    for members in plan_buckets(sizes, unit_numel):
        n = sum(sizes[i] for i in members)
        units.append(UnitShape(n, n))
    return units + [UnitShape(n, n) for n in shape.isolated]


def _unit_bytes(unit: UnitShape, setup: ZeroSetup) -> tuple[int, int, int, int, int]:
    """(params, grads, master, optimizer state elements, pieces) of one unit on this rank."""
    padded = _padded(unit.numel, setup)
    if setup.sharded:
        shard = padded // setup.world_size
        lo, hi = setup.rank * shard, (setup.rank + 1) * shard
    else:
        shard, lo, hi = padded, 0, padded
    params = (shard if setup.stage >= 3 else padded) * setup.param_bytes
    grads = (shard if setup.stage >= 2 else padded) * setup.grad_bytes
    # The master copy covers the owned range up to the first frozen parameter, padding
    # included when every parameter is trained (ShardedUnit.master_range).
    stepped_end = unit.stepped if unit.stepped < unit.numel else padded
    master = max(0, min(hi, stepped_end) - lo) * 4 if setup.master else 0
    # Optimizer pieces stop at the last trainable element: padding gets no moments.
    stepped = max(0, min(hi, unit.stepped) - lo)
    return params, grads, master, stepped, int(stepped > 0)


def _gathered(units: list[UnitShape], root: UnitShape | None, setup: ZeroSetup) -> int:
    """Stage 3: the most bytes of whole units held at once (``ParamGatherer.peak_bytes``).

    Persistent units (below the threshold) and the root stay gathered; around block ``i``
    in backward the gatherer holds ``i``, the block just finished, and the blocks before
    ``i`` that fit in ``prefetch_numel`` (counted in padded elements), within
    ``max_live_numel``.
    """
    full = [_padded(u.numel, setup) for u in units]
    persistent = [u.numel < setup.persistence_threshold for u in units]
    always = sum(f for f, p in zip(full, persistent, strict=True) if p)
    # The root unit (last, when there is one) is gathered for the whole pass.
    count = len(units) - (1 if root is not None else 0)
    if root is not None and not persistent[-1]:
        always += full[-1]
    blocks = list(zip(full[:count], persistent[:count], strict=True))
    window = 0
    for i, (f, p) in enumerate(blocks):
        if p:
            continue
        live = f + (blocks[i + 1][0] if i + 1 < len(blocks) and not blocks[i + 1][1] else 0)
        budget = setup.prefetch_numel
        for g, q in reversed(blocks[:i]):
            if q:
                continue
            if budget < g or always + live + g > setup.max_live_numel:
                break
            budget -= g
            live += g
        window = max(window, live)
    return min(always + window, sum(full)) * setup.param_bytes


def _staging(units: list[UnitShape], has_root: bool, setup: ZeroSetup, held: int = 0) -> int:
    """Gradient staging buffers (stages 2-3): buffers sized by the largest unit, and at
    stage 3 buffers for the batches of small units reduced together.

    A second buffer is allocated when one reduction is in flight while the next unit (or
    batch) fills (``overlap_comm``), and at stage 3 whenever the root unit stages through
    that pool: its early gradients (final norm, head) stay staged through the whole
    backward pass while the blocks' come and go. ``held`` units (a pipeline stage's tied
    modules at stages 0-2, summed across stages only after the step's last backward) each
    keep a buffer of their own through the step.
    """
    if setup.stage < 2 or not units:
        return 0
    largest = max(_padded(u.numel, setup) for u in units)
    if setup.stage < 3:
        flowing = len(units) - held
        count = (2 if setup.overlaps and flowing > 1 else 1) if flowing else 0
        return (count + held) * largest * setup.comm_bytes
    # Stage 3 reduces the last block first and the root last; runs of small units share
    # one collective and stage through buffers of their own (zero/grad_sync.py), sized for
    # the largest batch possible.
    blocks = units[:-1] if has_root else units
    sizes = [_padded(u.numel, setup) for u in [*reversed(blocks), *units[len(blocks) :]]]
    cap = reduce_batch_numel(setup.bucket_numel)
    batches = batch_small_units(sizes, [0] * len(sizes), cap)
    singles = [b for b in batches if len(b) == 1]
    grouped = [b for b in batches if len(b) > 1]
    root_single = has_root and len(batches[-1]) == 1
    count = (2 if (setup.overlaps or root_single) and len(singles) > 1 else 1) if singles else 0
    staging = count * largest
    if grouped:
        small = sum(n for n in sizes if n <= cap // 8)
        root_grouped = has_root and len(batches[-1]) > 1
        second = (setup.overlaps or root_grouped) and len(grouped) > 1
        staging += (2 if second else 1) * min(small, cap)
    return staging * setup.comm_bytes


def model_state_bytes(shape: ModelShape, setup: ZeroSetup) -> StateBytes:
    """Bytes of parameters, gradients, master weights, optimizer states, buffers, the
    gathered working set and staging on rank ``setup.rank``.

    Raises:
        ValueError: an unknown optimizer name.
    """
    if setup.optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {setup.optimizer!r}"
        )
    per_element, per_piece = OPTIMIZER_STATES[setup.optimizer]
    state_bytes = 4 if setup.master else setup.param_bytes
    root = shape.root
    units = list(shape.stage3_units) if setup.stage >= 3 else _plan_buckets(shape, setup)
    params = grads = master = stepped = pieces = 0
    for unit in units:
        p, g, m, s, k = _unit_bytes(unit, setup)
        params, grads, master, stepped, pieces = (
            params + p,
            grads + g,
            master + m,
            stepped + s,
            pieces + k,
        )
    kept_params = _kept_params(units, root, setup) if setup.stage >= 3 else 0
    # A rank owning nothing of the (single) group still steps an empty placeholder.
    pieces = max(pieces, 1) if units else 0
    loose = shape.frozen_numel * setup.param_bytes if setup.stage < 3 else 0
    buffers = sum(
        n * (setup.param_bytes if floating and setup.master else size)
        for n, size, floating in shape.buffers
    )
    return StateBytes(
        params=params + loose,
        grads=grads,
        master_weights=master,
        optimizer_states=stepped * per_element * state_bytes + pieces * per_piece,
        buffers=buffers,
        gathered=_gathered(units, root, setup) if setup.stage >= 3 else 0,
        staging=_staging(
            units,
            setup.stage >= 3 and root is not None,
            setup,
            held=len(shape.isolated) if setup.stage < 3 else 0,
        ),
        units=len(units),
        padding_elements=sum(_padded(u.numel, setup) - u.numel for u in units),
        stepped_elements=stepped,
        kept_params=kept_params,
    )


def _kept_params(units: list[UnitShape], root: UnitShape | None, setup: ZeroSetup) -> int:
    """Bytes of parameter shards that ``offload_param: nvme`` leaves in memory
    (``Offload.adopt``): units are built last block first, then the root."""
    blocks = units[:-1] if root is not None else units
    built = [*reversed(blocks), *([root] if root is not None else [])]
    kept = budget = 0
    for unit in built:
        shard = _padded(unit.numel, setup) // setup.world_size
        if unit.numel < setup.persistence_threshold or shard == 0:
            kept += shard
        elif budget + shard <= setup.max_in_cpu:
            budget += shard
            kept += shard
    return kept * setup.param_bytes

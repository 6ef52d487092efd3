"""``estimate_memory``: per-rank bytes of one training configuration, by category and by
where they live (accelerator, host memory, NVMe).

Offload (``offload_optimizer`` / ``offload_param``) places states where zerotrain's own
offload keeps them (docs/offload.md): the optimizer's moments and the fp32 master (on an
accelerator, an fp32 host copy even of fp32 parameters) in host memory or on NVMe; on a
CPU run with NVMe also the gradient slices (stages 2-3) and the stage-3 parameter shards
beyond ``max_in_cpu`` (units below the persistence threshold stay). Checked against
``memory_breakdown()`` on CPU runs (tests/dist/test_estimate_vs_breakdown.py); NVMe bytes
are before each region's 4 KiB alignment, and the step's chunk buffers are not included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zerotrain.estimate.activations import ActivationBytes, gpt_activation_bytes
from zerotrain.estimate.model_states import OPTIMIZER_STATES, StateBytes, ZeroSetup
from zerotrain.estimate.model_states import model_state_bytes as _state_bytes
from zerotrain.estimate.shapes import ModelShape, TransformerShape, shape_of_count, shape_of_module
from zerotrain.utils.memory import format_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
CATEGORIES = (
    "params",
    "grads",
    "master_weights",
    "optimizer_states",
    "buffers",
    "gathered",
    "staging",
    "activations",
)


@dataclass(frozen=True, slots=True)
class Placement:
    """Bytes of one category on each kind of storage."""

    device: int = 0
    cpu: int = 0
    nvme: int = 0

    @property
    def total(self) -> int:
        """Bytes wherever they live."""
        return self.device + self.cpu + self.nvme

    def __add__(self, other: Placement) -> Placement:
        return Placement(self.device + other.device, self.cpu + other.cpu, self.nvme + other.nvme)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted memory of one rank (rank ``rank``; rank 0 holds the most: padding sits at
    the end of each unit, in the last rank's range).

    Every category is a :class:`Placement`. ``device`` means the accelerator the rank
    trains on (the host itself when ``device_type`` is "cpu").

    Attributes:
        params / grads / master_weights / optimizer_states / buffers: model states, as
            ``MemoryBreakdown`` names them.
        gathered: stage 3: the most bytes of whole units gathered at once.
        staging: buffers gradients pass through to a reduce-scatter (stages 2-3).
        activations: saved activations plus the largest backward temporaries of one
            micro-batch (0 when the model shape or batch is unknown).
        num_params / world_size / stage / dtype / rank / device_type: the configuration.
        units: how many units the parameters form; padding_elements: their padding.
        exact: built from real parameter shapes (else from a parameter count).
        baseline_bytes: host memory of the process before any model state (interpreter,
            torch, communication); 0 unless given.
        notes: what the prediction assumes.
    """

    params: Placement
    grads: Placement
    master_weights: Placement
    optimizer_states: Placement
    buffers: Placement
    gathered: Placement
    staging: Placement
    activations: Placement
    num_params: int
    world_size: int
    stage: int
    dtype: str
    rank: int
    device_type: str
    units: int
    padding_elements: int
    exact: bool
    baseline_bytes: int = 0
    notes: tuple[str, ...] = ()

    def category(self, name: str) -> Placement:
        """The placement of category ``name`` (one of :data:`CATEGORIES`)."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown category {name!r}; one of {', '.join(CATEGORIES)}")
        value: Placement = getattr(self, name)
        return value

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients, master weights and optimizer states, wherever they live."""
        names = ("params", "grads", "master_weights", "optimizer_states")
        return sum(self.category(n).total for n in names)

    def _sum(self, where: str) -> int:
        return sum(getattr(self.category(n), where) for n in CATEGORIES)

    @property
    def total(self) -> int:
        """Bytes on the training device (what has to fit in one GPU's memory)."""
        return self._sum("device")

    @property
    def cpu_total(self) -> int:
        """Bytes in host memory (offloaded states; not the process baseline)."""
        return self._sum("cpu")

    @property
    def nvme_total(self) -> int:
        """Bytes on NVMe."""
        return self._sum("nvme")

    @property
    def host_bytes(self) -> int:
        """Predicted resident host memory: baseline + host-resident states, and everything
        when the rank trains on the CPU."""
        on_host = self.total if self.device_type == "cpu" else 0
        return self.baseline_bytes + self.cpu_total + on_host

    def table(self) -> str:
        """The estimate as a fixed-width table: one row per category, one column per
        storage kind that holds anything, then the totals."""
        columns = [("device", self.device_type.upper())]
        columns += [(k, k.upper()) for k in ("cpu", "nvme") if self._sum(k)]
        head = f"{'category':<18}" + "".join(f"{title:>14}" for _, title in columns)
        lines = [
            f"zerotrain estimate: {self.num_params:,} parameters, ZeRO stage {self.stage}, "
            f"{self.dtype}, world size {self.world_size}, rank {self.rank} "
            f"({self.units} units, {self.padding_elements:,} padding elements"
            f"{'' if self.exact else ', shapes assumed'})",
            head,
            "-" * len(head),
        ]
        for name in CATEGORIES:
            where = self.category(name)
            lines.append(
                f"{name:<18}"
                + "".join(f"{format_bytes(getattr(where, k)):>14}" for k, _ in columns)
            )
        lines.append("-" * len(head))
        totals = {"device": self.total, "cpu": self.cpu_total, "nvme": self.nvme_total}
        lines.append(
            f"{'total':<18}" + "".join(f"{format_bytes(totals[k]):>14}" for k, _ in columns)
        )
        lines.append(f"{'model states':<18}{format_bytes(self.model_state_bytes):>14}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _check(stage: int, world_size: int, rank: int, dtype: str) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")


def _dtype_bytes(name: str | None, dtype: str, what: str) -> int:
    """Element size of a gradient accumulation / communication dtype."""
    if name is None:
        return 4 if dtype != "fp32" else DTYPE_BYTES[dtype]  # fp32 under mixed precision
    allowed = ("fp32",) if dtype == "fp32" else ("fp32", dtype)
    if name not in allowed:
        raise ValueError(
            f"{what} {name!r} is not allowed when training in {dtype}; allowed: "
            f"{', '.join(allowed)}"
        )
    return DTYPE_BYTES[name]


def _offload(name: str | None, what: str) -> str:
    target = name or "none"
    if target not in OFFLOAD_TARGETS:
        raise ValueError(f"{what} must be one of {', '.join(OFFLOAD_TARGETS)}, got {name!r}")
    return target


def _place(
    states: StateBytes, setup: ZeroSetup, optimizer_to: str, param_to: str
) -> dict[str, Placement]:
    """Put each category on the device, or where zerotrain's offload moves it."""
    on_device = {
        name: Placement(device=getattr(states, name))
        for name in CATEGORIES
        if name != "activations"
    }
    on_cpu_run = setup.device == "cpu"
    memory = "device" if on_cpu_run else "cpu"  # where host-memory states are counted
    if optimizer_to != "none" and not (optimizer_to == "cpu" and on_cpu_run):
        per_element = OPTIMIZER_STATES[setup.optimizer][0]
        # The element-wise states move; the step counts (one per piece) stay in memory.
        moments = states.stepped_elements * per_element * 4
        counts = Placement(**{memory: states.optimizer_states - moments})
        on_device["optimizer_states"] = counts + Placement(**{optimizer_to: moments})
        master = states.master_weights
        if not setup.master and not on_cpu_run:
            master = states.stepped_elements * 4  # an fp32 host copy of fp32 parameters
        on_device["master_weights"] = Placement(**{optimizer_to: master})
    if optimizer_to == "nvme" and on_cpu_run and setup.stage >= 2:
        on_device["grads"] = Placement(nvme=states.grads)
    if param_to == "nvme":
        kept = states.kept_params
        on_device["params"] = Placement(device=kept, nvme=states.params - kept)
    return on_device


def estimate_memory(
    model: nn.Module | int,
    *,
    world_size: int,
    stage: int,
    dtype: str = "fp32",
    grad_accum_dtype: str | None = None,
    communication_dtype: str | None = None,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    transformer: TransformerShape | None = None,
    layers: int | None = None,
    optimizer: str = "adam",
    device: str = "cuda",
    rank: int = 0,
    bucket_numel: int | None = None,
    overlap: bool | None = None,
    prefetch_numel: int = 50_000_000,
    persistence_threshold: int = 100_000,
    max_live_numel: int = 1_000_000_000,
    unit_classes: tuple[str, ...] | None = None,
    baseline_bytes: int = 0,
    max_in_cpu: int = 1_000_000_000,
    tensor_parallel: int = 1,
    sequence_parallel: int = 1,
    isolate: Sequence[str] = (),
) -> MemoryEstimate:
    """Predict one rank's memory for training ``model`` with ZeRO.

    For a rank of a 3D job pass its piece of the model (``estimate.layout.rank_piece``)
    with ``world_size`` its ZeRO (data x sequence) group.

    Args:
        model: a module (its exact parameter shapes; build it on the meta device to pay
            nothing) or a parameter count.
        world_size: data-parallel ranks. stage: ZeRO stage 0-3.
        dtype: "fp32", or "bf16"/"fp16" (mixed precision with fp32 master weights).
        grad_accum_dtype / communication_dtype: ``data_types.grad_accum_dtype`` and
            ``communication_data_type`` (None: fp32 under mixed precision).
        offload_optimizer: "none", "cpu" or "nvme" (stages 1-3).
        offload_param: "none", "cpu" or "nvme" (stage 3; nvme on CPU runs only).
        micro_batch / seq_len: activations are estimated when both are given and the
            transformer shape is known (``transformer``, or read from the module's config).
        transformer: the model's shape for activations.
        layers: with a parameter count, how many equal blocks to assume (stage-3 working set).
        optimizer: "adam", "adamw", "lamb", "sgd" (with momentum) or "none".
        device: "cuda" or "cpu": the engine sizes buckets and overlap by it.
        rank: which rank to report (0 holds the most).
        bucket_numel / overlap / prefetch_numel / persistence_threshold / max_live_numel /
            unit_classes: the ``zero_optimization`` keys of the same names.
        baseline_bytes: host memory of the process before any model state (for RSS).
        max_in_cpu: ``offload_param.max_in_cpu``.
        tensor_parallel / sequence_parallel: the degrees, for activations (the model
            states come from the piece itself).
        isolate: name prefixes of parameters in a stage 0-2 unit of their own (a pipeline
            stage's tied modules: ``PipelineModule.tied_prefixes()``).

    Returns:
        The per-category bytes of rank ``rank``.

    Raises:
        ValueError: an unknown stage, dtype, offload target or optimizer, a world size
            below 1, offload at a stage that does not support it.
        TypeError: ``model`` is neither a module nor an int.
    """
    _check(stage, world_size, rank, dtype)
    optimizer_to = _offload(offload_optimizer, "offload_optimizer")
    param_to = _offload(offload_param, "offload_param")
    if optimizer_to != "none" and stage < 1:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage 0 got it)")
    if param_to != "none" and stage < 3:
        raise ValueError(f"offload_param needs ZeRO stage 3, got stage {stage}")
    if param_to == "nvme" and device != "cpu":
        raise ValueError("offload_param nvme is supported on CPU runs only (device 'cpu')")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    shape: ModelShape
    if isinstance(model, nn.Module):
        shape = shape_of_module(model, unit_classes, transformer, isolate)
    elif isinstance(model, int) and not isinstance(model, bool):
        shape = shape_of_count(model, layers or (transformer.layers if transformer else None))
        shape = dataclasses.replace(shape, transformer=transformer)
    else:
        raise TypeError(f"model must be an nn.Module or a parameter count, got {type(model)}")
    setup = ZeroSetup(
        stage=stage,
        world_size=world_size,
        rank=rank,
        param_bytes=DTYPE_BYTES[dtype],
        grad_bytes=_dtype_bytes(grad_accum_dtype, dtype, "grad_accum_dtype"),
        comm_bytes=_dtype_bytes(communication_dtype, dtype, "communication_dtype"),
        master=dtype != "fp32",
        optimizer=optimizer,
        device=device,
        bucket_numel=bucket_numel,
        overlap=overlap,
        prefetch_numel=prefetch_numel,
        persistence_threshold=persistence_threshold,
        max_live_numel=max_live_numel,
        max_in_cpu=max_in_cpu,
    )
    states = _state_bytes(shape, setup)
    placed = _place(states, setup, optimizer_to, param_to)
    notes: list[str] = []
    activations = ActivationBytes(0, 0)
    if micro_batch is not None or seq_len is not None:
        if micro_batch is None or seq_len is None:
            raise ValueError("activations need both micro_batch and seq_len")
        if shape.transformer is None:
            notes.append(
                "activations not estimated: the model's shape is unknown (pass "
                "--hidden/--layers/--heads/--vocab, or a model with a GPT-like config)"
            )
        else:
            activations = gpt_activation_bytes(
                shape.transformer,
                micro_batch,
                seq_len,
                DTYPE_BYTES[dtype],
                tensor=tensor_parallel,
                sequence=sequence_parallel,
            )
    if not shape.exact:
        notes.append(
            f"parameters taken as {len(shape.blocks)} equal blocks (no shapes given): "
            "padding and unit sizes are approximate"
        )
    if optimizer_to == "nvme" or param_to == "nvme":
        notes.append(
            "NVMe bytes before each swap region's 4 KiB alignment; the offloaded step's "
            "chunk buffers (buffer_count x 4M elements per swapped operand) come on top"
        )
    return MemoryEstimate(
        **placed,
        activations=Placement(device=activations.peak),
        num_params=shape.numel,
        world_size=world_size,
        stage=stage,
        dtype=dtype,
        rank=rank,
        device_type=device,
        units=states.units,
        padding_elements=states.padding_elements,
        exact=shape.exact,
        baseline_bytes=baseline_bytes,
        notes=tuple(notes),
    )

"""Setting up the 1-bit optimizers (config types ``OneBitAdam``, ``ZeroOneAdam``,
``OneBitLamb``): what they can run with, the buckets they see, the exchange they
communicate through, and the hand-over of gradient averaging from the engine to them.

DeepSpeed runs these only on CUDA/XPU (cupy), only without ZeRO, and forgets the error
feedback when a checkpoint is loaded. Here they run on every backend through zerotrain's own
communicator, at ZeRO stage 0 and 1 (1-bit Adam and 1-bit LAMB), and their error-feedback
buffers travel in checkpoints.
"""

from __future__ import annotations

from typing import Any

from zerotrain.comm.onebit import OneBitExchange, OneBitLayout, Segment, alignment
from zerotrain.config.optim_params import COMPRESSED_OPTIMIZERS, OPTIMIZER_DISPLAY
from zerotrain.config.policies import OptimizerSpec
from zerotrain.engine.param_groups import ParamGroups
from zerotrain.optim.compressed import Bucket, CompressedOptimizer, Piece
from zerotrain.optim.factory import check_group_options, hyperparameters
from zerotrain.optim.onebit_adam import OneBitAdam
from zerotrain.optim.onebit_lamb import OneBitLamb
from zerotrain.optim.zero_one_adam import ZeroOneAdam
from zerotrain.parallel.topology import Topology
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.logging import get_logger
from zerotrain.zero.strategy import ZeroStrategy

log = get_logger(__name__)

# Accepted as DeepSpeed accepts them; none changes what these optimizers compute.
_NO_EFFECT = {
    "bias_correction": (True, "the 1-bit optimizers never bias-correct (as in DeepSpeed)"),
    "eps_inside_sqrt": (False, "the 1-bit optimizers add eps outside the square root"),
    "cuda_aware": (False, "zerotrain's communicator chooses how buffers move"),
}
_IGNORED = (*_NO_EFFECT, "amsgrad", "comm_backend_name")


_CLASSES: dict[str, type[CompressedOptimizer]] = {
    "onebitadam": OneBitAdam,
    "zerooneadam": ZeroOneAdam,
    "onebitlamb": OneBitLamb,
}


def is_compressed(spec: OptimizerSpec | None) -> bool:
    """Whether ``spec`` names one of the 1-bit optimizers."""
    return spec is not None and spec.name in COMPRESSED_OPTIMIZERS


def check_compressed(spec: OptimizerSpec, stage: int, topology: Topology, data_ranks: int) -> int:
    """Refuse what the 1-bit optimizers cannot run with, say which keys have no effect, and
    return the multiple every unit's buffer must be padded to (``N * lcm(N, 8)``)."""
    name = OPTIMIZER_DISPLAY[spec.name]
    if stage >= 2:
        raise ValueError(
            f"{name} runs at ZeRO stage 0 or 1, not {stage}: once its warm-up is over, every "
            "rank folds its own gradient of the whole model into the momentum, and stages 2 "
            "and 3 keep only a shard of the averaged gradient. Use zero_optimization.stage 1 "
            "(the variance and the server error feedback are partitioned there)"
        )
    if spec.name == "zerooneadam" and stage == 1:
        raise ValueError(
            "ZeroOneAdam runs at ZeRO stage 0 only: in its local steps every rank updates all "
            "of its parameters with the frozen variance, so the variance cannot be partitioned "
            "(stage 1) without gathering it, or the parameters, at every step. Use "
            "zero_optimization.stage 0, or OneBitAdam at stage 1"
        )
    if topology.pipe > 1 or topology.tensor > 1 or topology.sequence > 1:
        raise NotImplementedError(
            f"{name} with pipeline, tensor or sequence parallelism is not implemented yet "
            f"(topology {topology}); it runs with data parallelism alone"
        )
    params = spec.params
    backend = params.get("comm_backend_name", "nccl")
    log.info(
        "%s: comm_backend_name '%s' maps to zerotrain's communicator (the 1-bit all-reduce "
        "runs over the job's own backend, with NumPy bit packing on CPU)",
        name,
        backend,
    )
    for key, (default, why) in _NO_EFFECT.items():
        if key in params and params[key] != default:
            log.info("%s: %s=%r has no effect: %s", name, key, params[key], why)
    return alignment(data_ranks)


def _bucket(unit: ShardedUnit) -> Bucket:
    layout = unit.buffer.layout
    spans = tuple(
        (spec.start, spec.end, pid) for spec, pid in zip(layout.params, unit.param_ids, strict=True)
    )
    runs: list[tuple[int, int, int]] = []
    for spec, group in zip(layout.params, unit.groups, strict=True):
        if group is None:
            continue
        if runs and runs[-1][2] == group and runs[-1][1] == spec.start:
            runs[-1] = (runs[-1][0], spec.end, group)
        else:
            runs.append((spec.start, spec.end, group))
    pieces = tuple(Piece(p.group, p.param, p.start, p.segments) for p in unit.pieces)
    return Bucket(layout.padded_numel, unit.owned, spans, tuple(runs), pieces, unit.full_gradient)


def _layout(buckets: list[Bucket], ranks: int, per_parameter: bool, num_ids: int) -> OneBitLayout:
    """The buckets with their scale groups: one per parameter (its id), or one for the whole
    model; the padding of each bucket in a group of its own (it stays exactly zero)."""
    padding = num_ids if per_parameter else 1
    segments: list[Segment] = []
    for b, bucket in enumerate(buckets):
        end = 0
        for start, stop, pid in bucket.params:
            group = pid if per_parameter else 0
            last = segments[-1] if segments else None
            if last is not None and (last.bucket, last.hi, last.group) == (b, start, group):
                segments[-1] = Segment(b, last.lo, stop, group)  # one run: one server scale
            else:
                segments.append(Segment(b, start, stop, group))
            end = stop
        if end < bucket.numel:
            segments.append(Segment(b, end, bucket.numel, padding))
    return OneBitLayout(ranks, tuple(b.numel for b in buckets), tuple(segments))


def build_compressed(
    spec: OptimizerSpec, strategy: ZeroStrategy, groups: ParamGroups, param_groups: list[Any]
) -> CompressedOptimizer:
    """The 1-bit optimizer ``spec`` names over ``strategy``'s units (``param_groups``: the
    pieces' groups, as every flat optimizer gets them), wired so the engine averages
    gradients only while the optimizer asks for it."""
    hyper = {k: v for k, v in hyperparameters(spec).items() if k not in _IGNORED}
    for i, options in enumerate(groups.options):
        if "exp_avg_mask" in options:
            raise ValueError(
                f"model_parameters group {i} sets 'exp_avg_mask': DeepSpeed's momentum mask "
                "(zeroing elements whose momentum must stay zero, such as positions beyond the "
                "trained sequence length) is not implemented yet in zerotrain's 1-bit "
                "optimizers; remove the key (buffer padding is kept at zero without it)"
            )
    check_group_options(list(hyper), [dict(o) for o in groups.options])
    buckets = [_bucket(unit) for unit in strategy.units]
    comm = strategy.comm
    cls = _CLASSES[spec.name]
    per_parameter = cls.scale_groups == "parameter"
    layout = _layout(buckets, comm.world_size, per_parameter, strategy.num_params)
    exchange = OneBitExchange(comm, layout, sharded=strategy.zero.shard_optimizer)
    if cls is OneBitLamb:
        hyper["num_ids"] = strategy.num_params
    optimizer = cls(param_groups, buckets, exchange, **hyper)
    strategy.window.set_gradient_averaging(optimizer.wants_averaged_gradients)
    return optimizer

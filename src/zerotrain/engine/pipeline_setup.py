"""What ``initialize`` does differently for a ``PipelineModule``: the grid comes from the
module (it was partitioned for it), the schedule from the config, and the stages holding
copies of a tied module get a group each, with equal starting values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from zerotrain.comm.agreement import failed_ranks
from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import PipelinePolicy, Policies
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.parallel.pipeline.builders import build_schedule
from zerotrain.parallel.pipeline.schedule import ActionType, PipelineSchedule
from zerotrain.parallel.pipeline.ties import (
    TiedGroup,
    broadcast_initial,
    build_tied_groups,
)
from zerotrain.parallel.topology import Topology
from zerotrain.zero.strategy import ZeroStrategy

if TYPE_CHECKING:
    from zerotrain.parallel.pipeline.module import PipelineModule


def pipeline_topology(
    module: PipelineModule, given: Topology | None, config_stages: int | None, world_size: int
) -> Topology:
    """The module's grid, checked against ``topology=`` and ``pipeline.stages``.

    Raises:
        ValueError: they disagree, or the grid does not cover the job.
    """
    topology = module.topology
    if topology is None:
        raise ValueError(
            "the PipelineModule was built for one stage (stage_id=) without a grid; build it "
            "with num_stages= or topology= inside the job"
        )
    if given is not None and given != topology:
        raise ValueError(
            f"initialize(topology={given}) differs from the grid the PipelineModule was "
            f"partitioned for ({topology}); pass the same Topology to both, or only to the module"
        )
    if config_stages is not None and config_stages != topology.pipe:
        raise ValueError(
            f"pipeline.stages={config_stages} in the config, but the PipelineModule has "
            f'{topology.pipe} stages; set them alike (or pipeline.stages to "auto")'
        )
    if topology.world_size != world_size:
        raise ValueError(
            f"the PipelineModule's grid {topology} has {topology.world_size} ranks, but the "
            f"job has {world_size} processes"
        )
    return topology


# Config keys whose value the PipelineModule fixed when it was built, by its attribute.
_BUILT_WITH = {
    "partition": "partition_method",
    "seed_layers": "seed_layers",
    "activation_checkpoint_interval": "activation_checkpoint_interval",
}


def check_built_as_configured(
    policy: PipelinePolicy, explicit: set[str], module: PipelineModule
) -> None:
    """The config's ``pipeline.partition``, ``seed_layers`` and
    ``activation_checkpoint_interval``, where given, must be what the module was built with:
    they act when it is built (as in DeepSpeed, where they are constructor arguments), so a
    differing config value would be silently ignored.

    Raises:
        ValueError: naming the key, both values and how to fix it.
    """
    resolved = {
        "partition": policy.partition_method.lower(),
        "seed_layers": policy.seed_layers,
        "activation_checkpoint_interval": policy.activation_checkpoint_interval,
    }
    for key, attribute in _BUILT_WITH.items():
        built = getattr(module, attribute)
        if key == "partition":
            built = built.lower()  # method names are case-insensitive
        if key in explicit and resolved[key] != built:
            raise ValueError(
                f"pipeline.{key}={resolved[key]!r} in the config, but the PipelineModule was "
                f"built with {attribute}={built!r}; the module's constructor argument decides "
                f"(it acts while the layers are built), so pass {attribute}="
                f"{resolved[key]!r} to PipelineModule or drop the key from the config"
            )


def prepare_pipeline(
    module: PipelineModule, cfg: ZeroTrainConfig, policies: Policies
) -> PipelineSchedule:
    """Everything about a pipeline that can be checked before the model is touched, and
    its schedule (identical on every rank, so every rank raises alike).

    Raises:
        ValueError / NotImplementedError: a config the module or this version cannot run.
    """
    explicit = set(cfg.pipeline.model_fields_set) if cfg.pipeline is not None else set()
    check_built_as_configured(policies.pipeline, explicit, module)
    offload = cfg.zero_optimization.offload_optimizer.device
    if offload == "nvme" and any(module.tied_keys_of_stage(s) for s in range(module.num_stages)):
        raise NotImplementedError(
            "offload_optimizer.device=nvme with tied pipeline layers (TiedLayerSpec): the "
            "copies' gradient slices are summed in memory, and NVMe offload streams them to "
            "disk; use cpu offload, or untie the layers"
        )
    return pipeline_schedule(
        policies.pipeline, module, policies.training.batch.gradient_accumulation_steps
    )


def check_tied_units(
    strategy: ZeroStrategy, ties: Sequence[TiedGroup], world: Communicator
) -> None:
    """Each tied module's parameters must fill units of their own (so the copies' slices
    line up); ``stage3_unit_classes`` can put them beside other parameters. Every rank
    raises alike.

    Raises:
        ValueError: naming the tie key and what to change.
    """
    problems = []
    for group in ties:
        own = strategy.units_under(group.prefix)
        held = {p.fqn for k in own for p in strategy.units[k].buffer.layout.params}
        every = {
            p.fqn
            for unit in strategy.units
            for p in unit.buffer.layout.params
            if p.fqn.startswith(group.prefix)
        }
        if not own or held != every:
            problems.append(group.key)
    failed = failed_ranks(world, bool(problems))
    if failed:
        raise ValueError(
            f"tied pipeline layer(s) {problems or '(on other ranks)'}: their parameters share "
            f"a ZeRO unit with other parameters on rank(s) {failed}, so the stages' copies "
            "cannot be summed slice by slice; drop zero_optimization.stage3_unit_classes "
            "for a PipelineModule (its layers and tied modules are the units already)"
        )


def pipeline_schedule(
    policy: PipelinePolicy, module: PipelineModule, micro_batches: int
) -> PipelineSchedule:
    """The instruction lists of every rank, with communication.

    Raises:
        ValueError: the schedule and the module's virtual stages disagree, or the schedule
            cannot run this many micro-batches (its builder says why).
    """
    if policy.virtual_stages != module.virtual_stages:
        raise ValueError(
            f"pipeline.virtual_stages={policy.virtual_stages} in the config, but the "
            f"PipelineModule was built with virtual_stages={module.virtual_stages}; set both alike"
        )
    interleaved = policy.schedule == "interleaved"
    if module.virtual_stages > 1 and module.num_stages < 2:
        raise ValueError(
            f"pipeline.virtual_stages={module.virtual_stages} with one pipeline stage: "
            "interleaving places the chunks of the model round a loop of at least 2 ranks; "
            "use pipeline.stages >= 2, or virtual_stages=1 (the whole model on this rank)"
        )
    if interleaved != (module.virtual_stages > 1):
        raise ValueError(
            f"pipeline.schedule={policy.schedule!r} with virtual_stages="
            f"{module.virtual_stages}: the interleaved schedule needs virtual_stages >= 2, "
            "and the others exactly 1"
        )
    schedule = build_schedule(
        policy.schedule, module.num_stages, micro_batches, module.virtual_stages
    )
    split = {ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT}
    if any(a.kind in split for rank in schedule.actions for a in rank):
        raise NotImplementedError(
            f"pipeline.schedule={policy.schedule!r} splits backward into input (I) and weight "
            "(W) gradients; zerotrain builds, simulates and exports it (parallel.pipeline."
            "builders), but its executor runs full backwards only: use 1f1b, gpipe or "
            "interleaved"
        )
    return schedule.with_communication()


def tied_groups(world: Communicator, module: PipelineModule) -> list[TiedGroup]:
    """The tie groups this rank belongs to, with the copies made equal (collective over
    ``world``)."""
    topology = module.topology
    if topology is None:
        return []
    holders: dict[str, list[int]] = {}
    for stage in range(topology.pipe):
        for key in module.tied_keys_of_stage(stage):
            holders.setdefault(key, []).append(stage)
    groups = build_tied_groups(world, topology, holders)
    params = {
        group.key: [
            p.data for name, p in module.named_parameters() if name.startswith(group.prefix)
        ]
        for group in groups
    }
    broadcast_initial(groups, params)
    return groups

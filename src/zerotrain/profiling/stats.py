"""Per-module numbers gathered while profiling, and their aggregation into a ``FlopsReport``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from zerotrain.profiling.report import FlopsReport, ModuleProfile
from zerotrain.utils.invariant import invariant


@dataclass(slots=True)
class BackwardRegion:
    """One forward call's backward: from its first output gradient to its last input gradient."""

    stats: ModuleStats
    begin: int | None = None  # FLOP total when it began; None before it begins and after
    done: bool = False  # its input gradients are computed


@dataclass(slots=True)
class OpenCall:
    """A forward call between its pre- and post-hook."""

    flops: int  # FLOP total at the pre-hook
    time: float  # perf_counter at the pre-hook
    region: BackwardRegion


@dataclass(slots=True)
class ModuleStats:
    """Running numbers of one module while profiling (its descendants included)."""

    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_latency_s: float = 0.0
    calls: int = 0
    numel: dict[int, int] = field(default_factory=dict)  # id(own parameter) -> elements seen
    open_calls: list[OpenCall] = field(default_factory=list)  # calls inside their forward


def build_report(
    model: nn.Module,
    stats: Mapping[nn.Module, ModuleStats],
    param_numel: Mapping[str, int],
    total_flops: int,
    latency_s: float,
) -> FlopsReport:
    """Turn per-module stats into a report: names, depths, parameter counts, totals.

    Args:
        model: the profiled model.
        stats: what the hooks gathered, per module instance.
        param_numel: full parameter sizes by FQN, overriding the sizes seen in forward.
        total_flops: everything the counter saw in the profiled span.
        latency_s: wall time of the span.
    """
    # By identity, so a tied weight is overridden under any of its names.
    override = {
        id(p): param_numel[name]
        for name, p in model.named_parameters(remove_duplicate=False)
        if name in param_numel
    }
    profiles: dict[nn.Module, ModuleProfile] = {}
    subtree: dict[nn.Module, dict[int, int]] = {}  # distinct parameters below each module

    def visit(module: nn.Module, name: str, depth: int) -> ModuleProfile:
        children = [
            visit(child, f"{name}.{child_name}" if name else child_name, depth + 1)
            for child_name, child in module.named_children()
            if child not in profiles  # a module reachable twice is listed once, like named_modules
        ]
        own = stats.get(module, ModuleStats())
        numel = {}
        for param in module.parameters(recurse=False):
            # Never called: the size now, which is 0 for a released stage-3 parameter.
            seen = own.numel.get(id(param), param.numel())
            numel[id(param)] = override.get(id(param), seen)
        for child in module.children():
            numel.update(subtree[child])
        subtree[module] = numel  # a dict keyed by parameter, so a tied weight counts once
        if own.calls:
            fwd, bwd, latency = own.fwd_flops, own.bwd_flops, own.fwd_latency_s
        else:  # a container never called itself (nn.ModuleList): the sum of its children
            fwd = sum(c.fwd_flops for c in children)
            bwd = sum(c.bwd_flops for c in children)
            latency = sum(c.fwd_latency_s for c in children)
        params = sum(numel.values())
        profile = ModuleProfile(
            name, type(module).__name__, depth, params, fwd, bwd, latency, own.calls
        )
        profiles[module] = profile
        return profile

    root = visit(model, "", 0)
    other = total_flops - root.fwd_flops - root.bwd_flops
    invariant(other >= 0, f"FlopsProfiler: module FLOPs exceed the total by {-other}")
    return FlopsReport(
        modules=tuple(profiles[m] for m in model.modules()),
        total_params=root.params,
        fwd_flops=root.fwd_flops,
        bwd_flops=root.bwd_flops,
        other_flops=other,
        step_latency_s=latency_s,
    )

"""``FlopsProfilerPolicy``: what the config's ``flops_profiler`` section asks for, as plain data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FlopsProfilerPolicy:
    """When to profile and how to print it (DeepSpeed's ``flops_profiler`` key names).

    Attributes:
        enabled: profile at all.
        profile_step: the 1-based global step whose forward + backward is profiled.
        module_depth: deepest module level shown (0 = the model itself); -1 shows every level.
        top_modules: how many module types to list per depth in the aggregated section.
        detailed: also print the per-module tree.
        output_file: write the table to this file instead of the log; ``None`` logs it.
    """

    enabled: bool = False
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    def __post_init__(self) -> None:
        if self.profile_step < 1:
            raise ValueError(
                f"flops_profiler.profile_step: got {self.profile_step}, expected an integer >= 1"
            )
        if self.module_depth < -1:
            raise ValueError(
                f"flops_profiler.module_depth: got {self.module_depth}, "
                "expected -1 (all levels) or an integer >= 0"
            )
        if self.top_modules < 1:
            raise ValueError(
                f"flops_profiler.top_modules: got {self.top_modules}, expected an integer >= 1"
            )

"""FLOPs profiler: FLOPs, parameters and forward latency per module for one training step.

- ``FlopsProfiler(model)``: ``with prof: <forward + backward>``, then ``prof.report()``.
- ``FlopsReport.table(module_depth, top_modules, detailed)``: the report as text.
- ``FlopsProfilerPolicy``: the config's ``flops_profiler`` section as plain data.

See docs/flops_profiler.md.
"""

from zerotrain.profiling.flops import FlopsProfiler, Phase
from zerotrain.profiling.policy import FlopsProfilerPolicy
from zerotrain.profiling.report import FlopsReport, ModuleProfile

__all__ = ["FlopsProfiler", "FlopsProfilerPolicy", "FlopsReport", "ModuleProfile", "Phase"]

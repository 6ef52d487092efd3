"""``FlopsProfiler``: FLOPs, parameters and forward latency per module for one training step.

How the numbers are made:

* FLOPs come from PyTorch's ``FlopCounterMode`` (a dispatch mode that knows the formulas of
  matmuls, convolutions and attention, forward and backward). We read only its running
  total. Its own per-module table names modules by a path rooted at the first module it sees
  (``Engine.module.blocks.0`` when an engine wraps the model), so instead our hooks attribute
  the *change* in that total to module instances: a forward call gets what was counted
  between its forward pre- and post-hook, a backward gets what was counted between the
  gradients of its outputs arriving and those of its inputs being done.
* Forward latency is ``time.perf_counter`` around the same hooks (CUDA synchronized first
  when the model lives on CUDA, else the timer sees only kernel launches).
* Parameters are counted in the forward pre-hook, where a ZeRO stage-3 module's parameters are
  gathered (released, they have 0 elements), unless ``param_numel`` gives the sizes.

Everything is installed by ``start()`` and removed by ``stop()``, also when the profiled code
raises (use the profiler as a context manager).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

from zerotrain.profiling.formulas import missing_formulas
from zerotrain.profiling.report import FlopsReport
from zerotrain.profiling.stats import BackwardRegion, ModuleStats, OpenCall, build_report
from zerotrain.utils.torch_compat import in_backward, queue_end_of_backward
from zerotrain.utils.tree import tensors_in


class Phase(enum.Enum):
    """Lifecycle of a profiler: ``IDLE -> PROFILING -> DONE``; an exception returns to IDLE."""

    IDLE = "idle"
    PROFILING = "profiling"
    DONE = "done"


class FlopsProfiler:
    """Profiles one (or a few) forward + backward passes of ``model``.

    Use as ``with FlopsProfiler(model) as prof: loss = model(x); loss.backward()`` (an
    optimizer step inside the block is fine: it adds no counted FLOPs), or with
    ``start()`` / ``stop()``; then ``prof.report()``.

    Args:
        model: the module whose forward is called in the profiled span; it may be wrapped by an
            engine (which then calls it) and its parameters may be ZeRO stage-3 partitioned.
        param_numel: optional full size of each parameter, by fully qualified name relative to
            ``model`` (for example from the engine's flat layouts). When given it is used for
            those parameters instead of the size seen in the forward pre-hook.
    """

    def __init__(self, model: nn.Module, *, param_numel: Mapping[str, int] | None = None) -> None:
        self.model = model
        self.phase = Phase.IDLE
        self._param_numel = dict(param_numel or {})
        self._stats: dict[nn.Module, ModuleStats] = {}
        self._regions: list[BackwardRegion] = []
        self._handles: list[RemovableHandle] = []
        self._counter: FlopCounterMode | None = None
        self._callback_queued = False
        self._sync: Callable[[], None] = _no_sync
        self._t0 = 0.0
        self._report: FlopsReport | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Install the hooks and the FLOP counter; forget any previous profile.

        Raises:
            RuntimeError: already profiling.
        """
        if self.phase is Phase.PROFILING:
            raise RuntimeError("FlopsProfiler.start(): already profiling; call stop() first")
        self._stats = {m: ModuleStats() for m in self.model.modules()}
        self._regions, self._report, self._callback_queued = [], None, False
        self._sync = _sync_for(self.model)
        try:
            for module in self._stats:
                pre = module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
                self._handles.append(pre)
                # prepend: run before a stage-3 hook releases the parameters, so the timed span
                # is the module's own work, not the release of its unit.
                post = module.register_forward_hook(self._post_forward, prepend=True)
                self._handles.append(post)
            counter = FlopCounterMode(display=False, custom_mapping=missing_formulas())
            counter.__enter__()
            self._counter = counter
            # The first op seen by a Python dispatch mode imports torch._dynamo (about a second);
            # pay that here, not inside the first module's timed forward.
            torch.empty(0)
        except BaseException:
            self._teardown()
            raise
        self.phase = Phase.PROFILING
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Remove every hook and the counter, and freeze the report.

        Raises:
            RuntimeError: not profiling.
        """
        if self.phase is not Phase.PROFILING:
            raise RuntimeError(f"FlopsProfiler.stop(): not profiling (phase {self.phase.value})")
        self._sync()
        latency = time.perf_counter() - self._t0
        total = self._total()
        self._close_regions()
        self._teardown()
        self._report = build_report(self.model, self._stats, self._param_numel, total, latency)
        self.phase = Phase.DONE

    def __enter__(self) -> FlopsProfiler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.stop()
            return
        # The profiled code failed: leave nothing installed and no half-made report.
        self._teardown()
        self.phase = Phase.IDLE

    def report(self) -> FlopsReport:
        """The profile of the last completed span.

        Raises:
            RuntimeError: no span has completed (never started, still running, or it raised).
        """
        if self.phase is not Phase.DONE or self._report is None:
            raise RuntimeError(
                f"FlopsProfiler.report(): no completed profile (phase {self.phase.value})"
            )
        return self._report

    def _teardown(self) -> None:
        """Remove hooks and exit the counter; safe to call twice and after a partial start."""
        handles, self._handles = self._handles, []
        counter, self._counter = self._counter, None
        try:
            for handle in handles:
                handle.remove()
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
        self._regions = []

    # -- hooks ----------------------------------------------------------------------------------

    def _total(self) -> int:
        return self._counter.get_total_flops() if self._counter is not None else 0

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if in_backward():
            return  # recomputation for activation checkpointing: it belongs to backward
        stats = self._stats[module]
        for param in module.parameters(recurse=False):
            # Inside the pre-hook a stage-3 parameter is gathered; outside it has 0 elements.
            stats.numel[id(param)] = max(stats.numel.get(id(param), 0), param.numel())
        region = BackwardRegion(stats)
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if inputs and torch.is_grad_enabled():
            # Fires once every input gradient of this call is computed: its backward is over.
            end = torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda _grads: self._end_backward(region)
            )
            self._handles.append(end)
        self._sync()
        stats.open_calls.append(OpenCall(self._total(), time.perf_counter(), region))

    def _post_forward(self, module: nn.Module, _args: Any, output: Any) -> None:
        if in_backward():
            return
        stats = self._stats[module]
        if not stats.open_calls:
            return  # profiling started inside this module's forward: nothing to close
        self._sync()
        call = stats.open_calls.pop()
        stats.fwd_latency_s += time.perf_counter() - call.time
        stats.fwd_flops += self._total() - call.flops
        stats.calls += 1
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            # Fires when the first output gradient arrives: this call's backward begins. ("all"
            # would never fire when an output is the loss that backward() starts from.)
            begin = torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda _grads: self._begin_backward(call.region), mode="any"
            )
            self._handles.append(begin)

    def _begin_backward(self, region: BackwardRegion) -> None:
        if self.phase is not Phase.PROFILING or region.done:
            return  # run after stop(), or an output that is an input (nn.Dropout(0) returns x)
        region.begin = self._total()
        self._regions.append(region)
        if not self._callback_queued:
            # A module whose inputs need no gradient (the model itself, an embedding) has no
            # "inputs done" signal: its backward ends with the whole backward pass.
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)

    def _end_backward(self, region: BackwardRegion) -> None:
        region.done = True
        if self.phase is not Phase.PROFILING or region.begin is None:
            return
        region.stats.bwd_flops += self._total() - region.begin
        region.begin = None
        self._regions.remove(region)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.phase is Phase.PROFILING:
            self._close_regions()

    def _close_regions(self) -> None:
        total = self._total()
        for region in self._regions:
            if region.begin is not None:
                region.stats.bwd_flops += total - region.begin
                region.begin = None
        self._regions = []


def _no_sync() -> None:
    return None


def _sync_for(model: nn.Module) -> Callable[[], None]:
    """Synchronize the model's CUDA device before reading the clock; nothing on CPU."""
    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if device is None:
        return _no_sync
    return lambda: torch.cuda.synchronize(device)

"""What the engine tells about itself: the periodic log line, the wall-clock breakdown, the
FLOPs profile of one step, the comms summary and the monitors (TensorBoard, CSV, wandb).

The engine calls ``phase(name)`` around the parts of a micro-step, ``before_forward`` and
``after_step`` at its edges, and ``close`` from ``destroy``; everything else happens here,
so the engine stays a facade. Only rank 0 writes monitors and logs tables; collectives
(the loss average, per-rank memory) run on every rank, decided by the config alone.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.comm.comms_logger import CommsLoggerPolicy
from zerotrain.config.policies import Policies
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.engine.wall_clock import WallClock
from zerotrain.estimate import MemoryEstimate, compare, estimate_memory
from zerotrain.estimate.model_states import OPTIMIZER_STATES
from zerotrain.monitor import Event, MonitorKind, MonitorPolicy, Monitors, tags
from zerotrain.profiling import FlopsProfiler, FlopsProfilerPolicy, Phase
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import format_bytes, peak_rss_bytes

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)

_MIB = float(1 << 20)


@dataclass(frozen=True, slots=True)
class TelemetryPolicy:
    """The reporting sections of the config, as plain data (built by ``initialize``)."""

    wall_clock_breakdown: bool = False
    flops: FlopsProfilerPolicy = field(default_factory=FlopsProfilerPolicy)
    comms: CommsLoggerPolicy = field(default_factory=CommsLoggerPolicy)
    monitors: tuple[MonitorPolicy, ...] = ()


class Telemetry:
    """Per-engine reporting state.

    Args:
        policy: what to report.
        device: the engine's device (wall-clock phases synchronize it when it is CUDA).
        rank: this process's data-parallel rank (only rank 0 writes monitors).
        memory_estimate: the estimator's prediction, printed next to the measured memory
            after the first step.
    """

    def __init__(
        self,
        policy: TelemetryPolicy,
        device: torch.device,
        rank: int,
        memory_estimate: MemoryEstimate | None = None,
    ) -> None:
        self.policy = policy
        self.memory_estimate = memory_estimate
        self.wall_clock = WallClock(policy.wall_clock_breakdown, device)
        self.monitors = Monitors(policy.monitors, rank=rank)
        self.rank = rank
        self.flops_profiler: FlopsProfiler | None = None
        self._steps_in_window = 0
        self._window_start = time.perf_counter()
        self._step_start = time.perf_counter()

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time ``name`` (see ``wall_clock.PHASES``) when ``wall_clock_breakdown`` is on."""
        return self.wall_clock.phase(name)

    # -- flops profiler -------------------------------------------------------------------------

    def before_forward(self, engine: Engine) -> None:
        """Start the FLOPs profiler on the first micro-step of the profiled step."""
        flops = self.policy.flops
        if not flops.enabled or self.flops_profiler is not None:
            return
        at_window_start = engine.micro_steps % engine.gradient_accumulation_steps() == 0
        if at_window_start and engine.global_steps + 1 == flops.profile_step:
            self.flops_profiler = FlopsProfiler(engine.module)
            self.flops_profiler.start()

    def _finish_flops_profile(self, engine: Engine) -> None:
        profiler = self.flops_profiler
        if profiler is None or profiler.phase is not Phase.PROFILING:
            return
        profiler.stop()
        flops = self.policy.flops
        report = profiler.report()
        text = (
            f"flops profile of step {engine.global_steps} "
            f"({engine.gradient_accumulation_steps()} micro-step(s), rank {self.rank}):\n"
            + report.table(flops.module_depth, flops.top_modules, flops.detailed)
        )
        if self.rank != 0:
            return
        if flops.output_file:
            path = Path(flops.output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
            log.info("flops profile of step %d written to %s", engine.global_steps, path)
        else:
            log.info("%s", text)

    # -- per step -------------------------------------------------------------------------------

    def after_step(self, engine: Engine, step_losses: list[torch.Tensor]) -> None:
        """After an optimizer step (applied or skipped): profile, monitors, periodic report.

        Args:
            engine: the engine that stepped.
            step_losses: the micro-batch losses of this step on this rank.
        """
        self._finish_flops_profile(engine)
        if engine.global_steps == 1 and self.memory_estimate is not None:
            log.info(
                "%s",
                compare(self.memory_estimate, engine.memory_breakdown(), peak_rss_bytes()),
            )
        now = time.perf_counter()
        step_seconds, self._step_start = now - self._step_start, now
        self._steps_in_window += 1
        if self.monitors.active:
            samples = engine.global_samples
            loss = torch.stack(step_losses).float().mean().item() if step_losses else 0.0
            events: list[Event] = [
                (tags.TRAIN_LOSS, loss, samples),
                (tags.GRAD_NORM, engine.get_global_grad_norm() or 0.0, samples),
                (tags.SAMPLES_PER_SEC, engine.train_batch_size() / step_seconds, samples),
            ]
            lrs = engine.get_lr_of_last_step()
            if lrs:
                events.append((tags.LEARNING_RATE, lrs[0], samples))
            if engine.loss_scaler is not None:
                events.append((tags.LOSS_SCALE, engine.loss_scale, samples))
            self.monitors.write(events)
        if engine.global_steps % engine.policy.steps_per_print == 0:
            self.report(engine)

    def reports_grad_norm(self, step: int, steps_per_print: int) -> bool:
        """Whether optimizer step number ``step`` (1-based) writes the gradient norm: to a
        monitor, or in the ``steps_per_print`` line. The same on every rank (it decides a
        collective): a monitor *configured*, not one active, which is rank 0 only."""
        return self.monitors.configured or step % steps_per_print == 0

    def report(self, engine: Engine) -> None:
        """The periodic log line (every ``steps_per_print`` steps) and what goes with it."""
        engine.strategy.outside_writes.report()
        # Average the window's loss over ranks: one tiny collective every steps_per_print.
        local = engine.loss_window.mean()
        mean_loss = engine.comm.all_reduce_floats([local])[0] / engine.comm.world_size
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        samples = self._steps_in_window * engine.train_batch_size()
        lrs = ", ".join(f"{lr:.3e}" for lr in engine.get_lr_of_last_step())
        message = (
            f"step {engine.global_steps}: loss {mean_loss:.4f}, lr [{lrs}], "
            f"grad norm {engine.get_global_grad_norm() or 0.0:.4f}, "
            f"{samples / elapsed:.1f} samples/s"
        )
        if engine.loss_scaler is not None:
            message += f", loss scale {engine.loss_scale:g}, {engine.skipped_steps} skipped"
        context = engine.activation_checkpointing
        if context.policy.profile:
            message += f"; {context.stats.summary()}"
            context.reset_stats()
        if engine.policy.log_memory:
            message += f", peak RSS {format_bytes(peak_rss_bytes())}; {engine.memory_breakdown()}"
        log.info(message)
        if self.wall_clock.enabled:
            log.info("%s", self.wall_clock.summary(self._steps_in_window))
            self.wall_clock.reset()
        if self.policy.comms.enabled:
            log.info("collectives so far:\n%s", engine.comm.comms_summary().table(by_size=False))
        if self.monitors.configured:
            self._write_memory(engine)
        engine.loss_window.clear()
        self._steps_in_window = 0
        self._window_start = time.perf_counter()

    def _write_memory(self, engine: Engine) -> None:
        """Every rank's peak memory to the monitors (a collective: every rank calls it)."""
        world, rank = engine.comm.world_size, engine.comm.rank
        cuda = engine.device.type == "cuda"
        mine = [0.0] * (2 * world)
        mine[rank] = peak_rss_bytes() / _MIB
        if cuda:
            mine[world + rank] = torch.cuda.max_memory_allocated(engine.device) / _MIB
        every = engine.comm.all_reduce_floats(mine)
        if not self.monitors.active:
            return
        samples = engine.global_samples
        events: list[Event] = [(tags.memory_tag(r), every[r], samples) for r in range(world)]
        if cuda:
            events += [
                (tags.memory_tag(r, tags.DEVICE_PEAK_ALLOCATED_MIB), every[world + r], samples)
                for r in range(world)
            ]
        self.monitors.write(events)

    def close(self) -> None:
        """Flush and close the monitors; remove a profiler still installed."""
        if self.flops_profiler is not None and self.flops_profiler.phase is Phase.PROFILING:
            self.flops_profiler.stop()
        self.monitors.close()


def telemetry_policy(cfg: ZeroTrainConfig) -> TelemetryPolicy:
    """The reporting sections of ``cfg`` as policies of the layers that do the work."""
    flops = cfg.flops_profiler
    flops_enabled = flops.enabled
    if flops_enabled and flops.profile_step < 1:
        # DeepSpeed compares the step counter with it, so a negative value never profiles.
        log.info(
            "config: flops_profiler.profile_step=%d: no step is profiled (steps count from 1)",
            flops.profile_step,
        )
        flops_enabled = False
    comms = cfg.comms_logger
    files = [
        MonitorPolicy(
            MonitorKind(name),
            enabled=section.enabled,
            output_path=section.output_path,
            job_name=section.job_name,
        )
        for name, section in (("tensorboard", cfg.tensorboard), ("csv_monitor", cfg.csv_monitor))
    ]
    wandb = cfg.wandb
    monitors = (
        *files,
        MonitorPolicy(
            MonitorKind.WANDB,
            enabled=wandb.enabled,
            project=wandb.project,
            group=wandb.group,
            team=wandb.team,
        ),
    )
    return TelemetryPolicy(
        wall_clock_breakdown=cfg.wall_clock_breakdown,
        flops=FlopsProfilerPolicy(
            enabled=flops_enabled,
            profile_step=max(flops.profile_step, 1),
            module_depth=flops.module_depth,
            top_modules=flops.top_modules,
            detailed=flops.detailed,
            output_file=flops.output_file,
        ),
        comms=CommsLoggerPolicy(
            enabled=comms.enabled,
            verbose=comms.verbose,
            prof_all=comms.prof_all,
            prof_ops=tuple(comms.prof_ops),
            debug=comms.debug,
        ),
        monitors=monitors,
    )


_DTYPE_NAMES: dict[torch.dtype | None, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def predict_memory(
    model: nn.Module, policies: Policies, rank: int, world_size: int, device: torch.device
) -> MemoryEstimate | None:
    """The estimator's prediction of this rank's model states, from the model's shapes before
    ``initialize`` moves its parameters into units (for ``memory_breakdown: true``, which
    prints it next to the measured figures after the first step). None where the
    optimizer is not one the estimator knows (a user's own)."""
    spec = policies.optimizer
    if spec is None or spec.name not in OPTIMIZER_STATES:
        log.info("memory estimate skipped: the estimator does not know this optimizer")
        return None
    precision, stage3, reduce = policies.precision, policies.stage3, policies.grad_reduce
    return estimate_memory(
        model,
        world_size=world_size,
        stage=policies.training.stage,
        dtype=_DTYPE_NAMES.get(precision.compute, "fp32"),  # None: the model's own, fp32 here
        grad_accum_dtype=_DTYPE_NAMES.get(precision.grad_accum),
        communication_dtype=_DTYPE_NAMES.get(precision.comm),
        optimizer=spec.name,
        device="cuda" if device.type == "cuda" else "cpu",
        rank=rank,
        bucket_numel=reduce.bucket_numel,
        overlap=reduce.overlap,
        prefetch_numel=stage3.prefetch_numel,
        persistence_threshold=stage3.persistence_threshold,
        max_live_numel=stage3.max_live_numel,
        unit_classes=stage3.unit_classes,
        offload_optimizer=policies.offload.optimizer,
        # Refused on an accelerator by the engine, with its own message.
        offload_param=policies.offload.param
        if policies.training.stage >= 3
        and (device.type == "cpu" or policies.offload.param != "nvme")
        else "none",
        max_in_cpu=policies.offload.max_in_cpu,
    )

"""Fault injection (issue 29): for ZeRO stages 0-3, with the shared-memory arena on and off,
stop (SIGSTOP) or kill (SIGKILL) a random rank at a random point of forward, backward, the
optimizer step or a checkpoint save, and check that

- every surviving rank raises, naming the rank that stopped answering (and no other), and
  exits within the detection timeout, which the test prints;
- nothing is left behind: no shared-memory segment of the job's processes, no partial
  checkpoint directory;
- the last complete checkpoint loads into a new job that resumes bit-exactly: its losses
  and final parameters equal those of a run that was never interrupted.

A cell is (stage, transport, phase, kill or stop): 64 of them. CI runs every cell once,
each with its own seed; ``ZEROTRAIN_FAULT_SEEDS=all`` runs all 20 seeds of every cell
(1280 jobs, about an hour and a half). Each cell's detection time is printed at the end
of the run (``tests/helpers/faults.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.faults import report_detection
from tests.helpers.training import (
    TINY,
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    zerotrain_config,
)
from zerotrain.testing.dist import JobOutcome, run_distributed, run_to_the_end
from zerotrain.testing.faults import CallCounter, Fault, FaultAt, read_marker

pytestmark = pytest.mark.faults

STAGES = (0, 1, 2, 3)
PHASES = ("forward", "backward", "step", "save")
KINDS = ("kill", "stop")
SEEDS = 20
WORLD = 2
STEPS = 6
SAVE_AFTER = (0, 2, 4)  # checkpoints after these steps: global_step1, 3 and 5
HEARTBEAT_TIMEOUT = 2.0  # shared memory: a silent peer is named after this
COMM_TIMEOUT = 30.0  # gloo: long, so that a stopped peer must be named by the watchdog
HEARTBEAT_WINDOW = 2.0  # gloo: after a failure, peers silent this long are named
SLACK = 5.0  # scheduling on a loaded 2-core machine
WATCHDOG_POLLS = 2.0  # gloo: the peer watchdog's looks at the store (named at the timeout)

MODEL = dataclasses.replace(TINY, dropout=0.1)  # random streams must resume exactly too


def _spec(stage: int) -> RunSpec:
    return RunSpec(stage=stage, model=MODEL, micro_batch=2, grad_accum=2, steps=STEPS)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where the fault hits: ``rank`` gets ``kind`` in ``phase`` of ``step`` (micro-batch
    ``micro``), at ``fraction`` of the phase's call events (counted on its previous
    occurrence)."""

    phase: str
    rank: int
    kind: str
    step: int
    micro: int
    fraction: float
    marker: str

    @staticmethod
    def draw(phase: str, kind: str, seed: int, marker: str) -> Plan:
        rng = random.Random(f"{phase}-{seed}")
        # A save after the first (that one calibrates); other phases: a step with a previous
        # one (calibration) and a next one (the survivors' next collective).
        step = rng.choice(SAVE_AFTER[1:]) if phase == "save" else rng.randint(1, STEPS - 2)
        # The optimizer step does its work at the accumulation boundary (micro-batch 1).
        micro = 1 if phase == "step" else rng.randint(0, 1) if phase != "save" else 0
        return Plan(phase, rng.randrange(WORLD), kind, step, micro, rng.random(), marker)

    def previous(self) -> tuple[int, int]:
        """The occurrence of the phase whose events are counted."""
        if self.phase == "save":
            return SAVE_AFTER[SAVE_AFTER.index(self.step) - 1], 0
        return self.step - 1, self.micro


class _Phases:
    """Wraps each phase of the training loop: counts the calibration occurrence and fires
    the fault in the chosen one, on the chosen rank only."""

    def __init__(self, plan: Plan | None) -> None:
        mine = plan is not None and plan.rank == dist.get_rank()
        self.plan = plan if mine else None
        self.counter = CallCounter()

    def __call__(self, phase: str, step: int, micro: int) -> Any:
        plan = self.plan
        if plan is None or phase != plan.phase:
            return _Nothing()
        if (step, micro) == plan.previous():
            return self.counter
        if (step, micro) == (plan.step, plan.micro):
            event = max(1, round(plan.fraction * self.counter.count))
            return FaultAt(Fault(plan.kind, event, plan.marker))
        return _Nothing()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _train(stage: int, checkpoints: str, resume: bool, plan: Plan | None) -> dict[str, Any]:
    """Every rank: train ``STEPS`` steps of the tiny GPT (from the latest checkpoint when
    ``resume``), saving after the steps in ``SAVE_AFTER``; returns this rank's losses by
    step and the final parameters."""
    spec = _spec(stage)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, WORLD))
    if resume:
        engine.load_checkpoint(checkpoints)
    phases = _Phases(plan)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    losses: dict[int, list[float]] = {}
    for step in range(engine.global_steps, STEPS):
        losses[step] = []
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            with phases("forward", step, micro):
                loss = engine(x, y)
            with phases("backward", step, micro):
                engine.backward(loss)
            with phases("step", step, micro):
                engine.step()
            losses[step].append(loss.item())
        if step in SAVE_AFTER:
            with phases("save", step, 0):
                engine.save_checkpoint(checkpoints)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "loaded_at": STEPS - len(losses)}


def _env(shm: bool) -> dict[str, str]:
    return {
        "ZEROTRAIN_SHM": "1" if shm else "0",
        "ZEROTRAIN_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
    }


_REFERENCES: dict[tuple[int, bool], list[dict[str, Any]]] = {}


def _reference(stage: int, shm: bool, tmp: Path) -> list[dict[str, Any]]:
    """The uninterrupted run (once per stage and arena setting)."""
    key = (stage, shm)
    if key not in _REFERENCES:
        path = tmp / "reference"
        _REFERENCES[key] = run_distributed(
            _train, WORLD, stage, str(path), False, None, env=_env(shm), timeout=120
        )
    return _REFERENCES[key]


# How a survivor names the ranks it lost: "rank(s) [1] exited" (seen through /proc) or
# "rank(s) [1] stopped answering" (its heartbeat stood still).
_NAMED = re.compile(r"rank\(s\) \[([0-9, ]+)\] (?:exited|stopped answering)", re.IGNORECASE)


def _detection_limit(shm: bool, kind: str) -> float:
    if shm:  # an exited peer at once (/proc), a stopped one by its heartbeat
        return HEARTBEAT_TIMEOUT + SLACK
    if kind == "kill":  # gloo sees the closed connection at once, then the heartbeat window
        return HEARTBEAT_WINDOW + SLACK
    # The peer watchdog (on by default, at the heartbeat timeout): silence counted from the
    # start of the wait.
    return HEARTBEAT_TIMEOUT + WATCHDOG_POLLS + SLACK


def _check_survivors(outcome: JobOutcome, plan: Plan, shm: bool) -> list[float]:
    """Each survivor raised naming exactly the victim, in time, and exited; returns the
    detection times."""
    fired = read_marker(plan.marker)
    assert fired is not None, "the fault never fired"
    fired_at, where = fired
    victim = outcome.ranks[plan.rank]
    assert victim.status == ("died" if plan.kind == "kill" else "stopped"), victim
    times = []
    for rank in outcome.ranks:
        if rank.rank == plan.rank:
            continue
        # Over gloo a stopped peer is named by the peer watchdog, which ends the waiting
        # rank (exit code 75; its wait cannot be interrupted) with the message in its log.
        watchdog = not shm and plan.kind == "stop"
        ended = (rank.status, rank.exitcode) if watchdog else (rank.status, None)
        assert ended == (("died", 75) if watchdog else ("error", None)), (
            f"rank {rank.rank} {rank.status} after the fault at {where}:\n{rank.value}\n"
            f"{rank.output}"
        )
        said = rank.output if watchdog else rank.value
        named = {int(r) for m in _NAMED.findall(said) for r in m.split(",")}
        assert named == {plan.rank}, (
            f"rank {rank.rank} named {sorted(named)}, not [{plan.rank}] (fault at {where}):\n{said}"
        )
        assert rank.exited, f"rank {rank.rank} reported but did not exit:\n{rank.output}"
        seconds = rank.reported_at - fired_at
        limit = _detection_limit(shm, plan.kind)
        assert seconds <= limit, f"rank {rank.rank} took {seconds:.1f} s (> {limit} s)"
        times.append(seconds)
    return times


def _check_nothing_left(outcome: JobOutcome, checkpoints: Path) -> None:
    assert outcome.leftover_segments == [], outcome.leftover_segments
    hidden = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("."))
    assert hidden == [], f"left in {checkpoints}: {hidden}"


def _check_resume(stage: int, shm: bool, checkpoints: Path, reference: list[dict]) -> int:
    """The latest complete checkpoint resumes bit-exactly; returns the step it resumed at."""
    resumed = run_distributed(
        _train, WORLD, stage, str(checkpoints), True, None, env=_env(shm), timeout=120
    )
    for rank, (got, want) in enumerate(zip(resumed, reference, strict=True)):
        start = got["loaded_at"]
        assert start >= 1, got["loaded_at"]
        assert got["losses"] == {s: want["losses"][s] for s in range(start, STEPS)}, rank
        for name, param in want["params"].items():
            assert torch.equal(got["params"][name], param), (rank, name)
    return resumed[0]["loaded_at"]


def _cases() -> list[Any]:
    everything = os.environ.get("ZEROTRAIN_FAULT_SEEDS") == "all"
    cells = list(itertools.product(STAGES, (True, False), PHASES, KINDS))
    if everything:
        return [_case(*cell, seed) for cell in cells for seed in range(SEEDS)]
    # CI: every cell once, with seeds spread over the 20 (a different draw of rank, step
    # and point in the phase in each).
    return [_case(*cell, (7 * index) % SEEDS) for index, cell in enumerate(cells)]


def _case(stage: int, shm: bool, phase: str, kind: str, seed: int) -> Any:
    name = f"stage{stage}-{'shm' if shm else 'gloo'}-{phase}-{kind}-seed{seed}"
    return pytest.param(stage, shm, phase, kind, seed, id=name)


@pytest.mark.parametrize(("stage", "shm", "phase", "kind", "seed"), _cases())
def test_a_rank_stopped_or_killed_is_named_and_the_job_resumes(
    tmp_path: Path, stage: int, shm: bool, phase: str, kind: str, seed: int
) -> None:
    reference = _reference(stage, shm, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    plan = Plan.draw(phase, kind, seed, str(tmp_path / "fired"))
    started = time.monotonic()
    outcome = run_to_the_end(
        _train,
        WORLD,
        stage,
        str(checkpoints),
        False,
        plan,
        env=_env(shm),
        timeout=90,
        comm_timeout=COMM_TIMEOUT,
    )
    times = _check_survivors(outcome, plan, shm)
    _check_nothing_left(outcome, checkpoints)
    resumed_at = _check_resume(stage, shm, checkpoints, reference)
    where = read_marker(plan.marker)[1]  # type: ignore[index]
    report_detection(
        f"stage {stage} {'shm ' if shm else 'gloo'} {phase:8s} {kind}: rank {plan.rank} named "
        f"in {', '.join(f'{t:.1f}' for t in times)} s (step {plan.step}, at {where}); "
        f"resumed from step {resumed_at} ({time.monotonic() - started:.0f} s)"
    )

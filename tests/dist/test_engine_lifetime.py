"""A dropped engine frees what it made: the model, its shards and its shared-memory arenas.

Two leaks kept them until the process ended (found by the test pool's between-test check):
the gradient hooks, held by autograd from C++ where the garbage collector cannot see them,
closed a cycle through the units back to the parameters; at stage 3 the side table of
parameter homes held the gatherer (and through it its own keys); and the heartbeat thread
held every arena it ticked across its wait. A process that builds engines one after another
(a sweep, a notebook, a test pool) grew by a model per engine.
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, make_model, run_training, zerotrain_config
from zerotrain.testing.dist import run_distributed


def _arena_files() -> int:
    found = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            found += "/dev/shm/zerotrain-" in os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
    return found


def _freed_after_drop(stages: list[int]) -> dict[int, tuple[bool, bool, int]]:
    """Per stage: (model freed, engine freed, arena files still open) after two steps and
    ``del``."""
    out = {}
    for stage in stages:
        before = _arena_files()
        spec = RunSpec(steps=2, stage=stage)
        model = make_model(spec)
        config = zerotrain_config(spec, dist.get_world_size())
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engine, *_ = zerotrain.initialize(model=model, config=config)
        run_training(engine, spec, model)
        refs = weakref.ref(model), weakref.ref(engine)
        del model, engine
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            gc.collect()
            if all(r() is None for r in refs) and _arena_files() == before:
                break
            time.sleep(0.05)
        out[stage] = (refs[0]() is None, refs[1]() is None, _arena_files() - before)
    return out


def test_a_dropped_engine_frees_its_model_and_arenas_at_every_stage():
    for rank, per_stage in enumerate(run_distributed(_freed_after_drop, 2, [0, 1, 2, 3])):
        for stage, (model_freed, engine_freed, arenas_open) in per_stage.items():
            assert engine_freed, f"rank {rank}, stage {stage}: the engine outlived its last user"
            assert model_freed, f"rank {rank}, stage {stage}: the model outlived its engine"
            assert arenas_open == 0, f"rank {rank}, stage {stage}: {arenas_open} arena file(s)"

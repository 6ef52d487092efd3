"""Ulysses sequence parallelism through the engine trains exactly like one process.

The demo GPT (its attention cores named by ``Block._sp_plan``) trains 20 steps with AdamW,
clipping active and a loss spike; every rank of a sequence group feeds its slice of the same
samples (``engine.shard_sequence``). Losses and every parameter must match single-process
training of the same global batch within 1e-5: at degree 2 and 4, with data parallelism and
ZeRO-3 around it, with tensor parallelism inside it, at degree 3, where neither the 16
positions nor the 4 heads divide (slices of 6, 5, 5 positions, heads 2, 1, 1), and inside
a 2-stage pipeline (ZeRO-1 and 3), each sequence rank's pipeline carrying its slices.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.pipeline import (
    MICRO_BATCHES,
    PIPE_GPT,
    PipeRun,
    micro_batches,
    mismatches,
    stage_params,
)
from tests.helpers.pipeline import train_reference as pipeline_reference
from tests.helpers.tensor import (
    TP_GPT,
    TensorRun,
    make_engine,
    train_reference,
    train_tensor_parallel,
)
from zerotrain.examples.gpt import GPT, gpt_loss_fn, gpt_pipeline_layers, gpt_pipeline_micro_batch
from zerotrain.parallel import Topology
from zerotrain.parallel.tensor import tensor_parallel_rng
from zerotrain.pipe import PipelineModule
from zerotrain.testing.dist import run_distributed

TOL = 1e-5

RUNS = {
    "sp2": TensorRun(tensor=1, sequence=2),
    "sp4": TensorRun(tensor=1, sequence=4),
    "sp3-uneven-heads-and-length": TensorRun(tensor=1, sequence=3),
    "sp2xdp2-stage3": TensorRun(tensor=1, sequence=2, data=2, zero_stage=3),
    "sp2xtp2-stage2": TensorRun(tensor=2, sequence=2, zero_stage=2),
}


@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
def test_ulysses_gpt_matches_one_process(run):
    reference = train_reference(run)
    results = run_distributed(train_tensor_parallel, run.world, run, timeout=300)
    for rank, result in enumerate(results):
        problems = mismatches(result, reference, TOL)
        assert not problems, f"rank {rank}: " + "; ".join(problems[:6])


class _Unplanned(torch.nn.Module):
    """Attention somewhere inside, but nothing says where."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


def _refusals() -> dict[str, str]:
    found = {}
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}
    attempts = {
        "no plan": lambda: zerotrain.initialize(model=_Unplanned(), config=config),
        "pipeline": lambda: zerotrain.initialize(
            model=PipelineModule(
                gpt_pipeline_layers(TP_GPT), topology=Topology(pipe=2), loss_fn=gpt_loss_fn
            ),
            config=config,
        ),
        "topology": lambda: zerotrain.initialize(
            model=GPT(TP_GPT),
            config={**config, "sequence_parallel_size": 2},
            topology=Topology(data=2),
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = "accepted"
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    engine, _, _, _ = zerotrain.initialize(model=GPT(TP_GPT), config=config)
    ids = torch.zeros(1, 8, dtype=torch.long)
    try:
        engine.shard_sequence({"input_ids": ids, "attention_mask": (ids == 0).long().tril()})
        found["padding"] = "accepted"
    except ValueError as err:
        found["padding"] = str(err)
    return found


def test_what_cannot_run_under_ulysses_is_refused_by_name():
    found = run_distributed(_refusals, 2, timeout=120)[0]
    assert "_sp_plan" in found["no plan"], found["no plan"]
    assert "_Unplanned" in found["no plan"], found["no plan"]
    assert "sequence axis of 1" in found["pipeline"], found["pipeline"]
    assert "sequence axis of 1" in found["topology"], found["topology"]
    assert "padding" in found["padding"], found["padding"]


PIPE_STEPS = 20


def _pipeline_by_sequence(zero_stage: int) -> dict:
    """PP=2 x SP=2: each sequence rank's pipeline carries its slice of every micro-batch."""
    topology = Topology(pipe=2, sequence=2)
    module = PipelineModule(
        gpt_pipeline_layers(PIPE_GPT), topology=topology, loss_fn=gpt_loss_fn, seed_layers=True
    )
    config = PipeRun(stages=2, zero_stage=zero_stage).config(1)
    config["sequence_parallel_size"] = 2
    engine, _, _, _ = zerotrain.initialize(model=module, config=config, topology=topology)
    losses = []
    for step in range(PIPE_STEPS):
        batches = [
            gpt_pipeline_micro_batch(engine.shard_sequence({"idx": x, "targets": y}))
            for x, y in micro_batches(engine, step, MICRO_BATCHES)
        ]
        losses.append(float(engine.train_batch(iter(batches))))
    return {"losses": losses, "params": stage_params(engine)}


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_pipeline_by_ulysses_matches_one_process(zero_stage):
    reference = pipeline_reference(steps=PIPE_STEPS)
    results = run_distributed(_pipeline_by_sequence, 4, zero_stage, timeout=300)
    for rank, result in enumerate(results):
        problems = mismatches(result, reference, TOL)
        assert not problems, f"rank {rank}: " + "; ".join(problems[:6])


def _draws() -> dict:
    """What the default stream and the tensor-parallel region stream draw after
    ``initialize`` on SP=2 x TP=2 (every rank seeded alike before)."""
    torch.manual_seed(0)
    run = TensorRun(tensor=2, sequence=2, dropout=0.1)
    engine, model = make_engine(run)
    shared = torch.rand(3)
    with tensor_parallel_rng(model.blocks[0].attn):
        region = torch.rand(3)
    return {
        "coords": engine.topology.coordinates(dist.get_rank()),
        "shared": shared,
        "region": region,
    }


def test_sequence_ranks_draw_independent_dropout_masks():
    """Each sequence rank's slice (and, in attention, its heads) gets its own masks; tensor
    ranks at one sequence coordinate share the default stream, as tensor parallelism needs,
    and each rank has its own region stream."""
    draws = run_distributed(_draws, 4, timeout=120)
    by_sequence: dict[int, list[torch.Tensor]] = {}
    for d in draws:
        by_sequence.setdefault(d["coords"].sequence, []).append(d["shared"])
    for same in by_sequence.values():
        assert all(torch.equal(same[0], other) for other in same), same
    assert not torch.equal(by_sequence[0][0], by_sequence[1][0])
    regions = [d["region"] for d in draws]
    assert all(not torch.equal(a, b) for i, a in enumerate(regions) for b in regions[i + 1 :])


def _length_all_gathers(sequence: int) -> dict:
    """All-gathers of slice lengths in one forward and backward: of batches from
    shard_sequence (two cut first, then run, as a loop over a window may), and of one cut
    by hand."""
    from zerotrain.parallel.sequence import sequence_slice

    run = TensorRun(tensor=1, sequence=sequence)
    engine, _ = make_engine(run)
    gen = torch.Generator().manual_seed(3)

    def tokens(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.randint(0, TP_GPT.vocab_size, (2, length + 1), generator=gen)
        return seq[:, :-1], seq[:, 1:]

    def gathers(batch: dict) -> int:
        engine.reset_comm_stats()
        engine.backward(engine(**batch))
        return engine.comm_stats().get(op="all_gather", purpose="control").calls

    even, uneven = tokens(12), tokens(13)  # 12 divides by 2 and 3, 13 by neither
    first = engine.shard_sequence({"idx": even[0], "targets": even[1]})
    second = engine.shard_sequence({"idx": uneven[0], "targets": uneven[1]})
    where = sequence_slice(12, engine.groups.sequence)
    return {
        "even": gathers(first),
        "uneven": gathers(second),
        "by_hand": gathers({"idx": even[0][:, where], "targets": even[1][:, where]}),
    }


@pytest.mark.parametrize("sequence", [2, 3])
def test_a_sharded_batch_needs_no_all_gather_of_slice_lengths(sequence):
    """T4 (review 2026-11-28): every attention call all-gathered the ranks' slice lengths
    (a collective and a host sync per layer). A forward of a batch engine.shard_sequence
    cut evenly needs none: the engine knows every rank's length. Uneven slices and batches
    cut by hand still gather them (a rank-local shortcut could let one rank skip the
    collective another makes). The parity tests above check the numbers."""
    layers = TP_GPT.n_layer
    for rank, got in enumerate(run_distributed(_length_all_gathers, sequence, sequence)):
        assert got == {"even": 0, "uneven": layers, "by_hand": layers}, (rank, got)

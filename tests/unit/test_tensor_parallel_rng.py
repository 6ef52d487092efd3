"""The tensor-parallel dropout stream is made without touching the process's generators.

``torch.manual_seed`` reseeds every generator (the CPU's and each GPU's): the stream made
with it on a GPU left each tensor rank's CPU generator at a different seed, so CPU-side
randomness (a collator's masking, an unseeded shuffle) differed across a tensor group that
must see identical inputs, silently (review 2026-11-28, T1).
"""

from __future__ import annotations

import torch

from zerotrain.comm.local import LocalCommunicator
from zerotrain.parallel.tensor import TensorParallelRNG
from zerotrain.parallel.tensor.rng import MEGATRON_OFFSET


def test_the_stream_is_seeded_privately_and_the_process_generator_is_untouched(monkeypatch):
    def reseeds_everything(seed: int) -> None:
        raise AssertionError("torch.manual_seed reseeds the CPU generator too")

    monkeypatch.setattr(torch, "manual_seed", reseeds_everything)
    torch.random.default_generator.manual_seed(99)
    before = torch.get_rng_state()
    rng = TensorParallelRNG(LocalCommunicator(torch.device("cpu"), None), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    with rng.fork():
        drawn = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the shared stream did not move
    own = torch.Generator().manual_seed(7 + MEGATRON_OFFSET + 0)
    assert torch.equal(drawn, torch.rand(4, generator=own))

"""The compressed all-reduce on real ranks: every rank ends with the same values, error
feedback loses nothing over time (what was sent plus what is still held equals the true
sum), exact inputs come through exactly, and the wire carries 2 bits per element."""

from __future__ import annotations

import pytest
import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.onebit import OneBitAllReduce, OneBitLayout, Segment, padded
from zerotrain.testing.dist import run_distributed

# Two buckets as a model's units would be: uneven parameter lengths, padding at the end.
PARAMS = [(0, 37), (0, 200), (0, 5), (1, 411), (1, 64)]


def _layout(world: int) -> tuple[OneBitLayout, list[int]]:
    sizes_real = [sum(n for b, n in PARAMS if b == bucket) for bucket in (0, 1)]
    sizes = [padded(n, world) for n in sizes_real]
    segments, at = [], [0, 0]
    for group, (bucket, n) in enumerate(PARAMS):
        segments.append(Segment(bucket, at[bucket], at[bucket] + n, group))
        at[bucket] += n
    padding_group = len(PARAMS)
    for bucket, size in enumerate(sizes):
        if at[bucket] < size:
            segments.append(Segment(bucket, at[bucket], size, padding_group))
    return OneBitLayout(world, tuple(sizes), tuple(segments)), sizes_real


def _inputs(rank: int, step: int, sizes: list[int], real: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for size, n in zip(sizes, real, strict=True):
        t = torch.zeros(size)
        t[:n] = torch.randn(n, generator=gen) * (1 + rank)
        out.append(t)
    return out


def _feedback(steps: int) -> dict:
    comm = Communicator()
    layout, real = _layout(comm.world_size)
    sizes = list(layout.sizes)
    reduce = OneBitAllReduce(comm, layout)
    worker = [torch.zeros(s) for s in sizes]
    server = [torch.zeros(reduce.server_error_numel(b)) for b in range(len(sizes))]
    sent = [torch.zeros(s, dtype=torch.float64) for s in sizes]
    true = [torch.zeros(s, dtype=torch.float64) for s in sizes]
    outputs = []
    comm.stats.reset()
    for step in range(steps):
        mine = _inputs(comm.rank, step, sizes, real)
        for r in range(comm.world_size):  # every rank's input, to know the true average
            for b, x in enumerate(_inputs(r, step, sizes, real)):
                true[b] += x.double() / comm.world_size
        reduce(mine, worker, server, label="test")
        for b, x in enumerate(mine):
            sent[b] += x.double()
        outputs.append([x.clone() for x in mine])
    return {
        "outputs": outputs,
        "sent": sent,
        "true": true,
        "worker": worker,
        "server": server,
        "volume": comm.stats.snapshot().get(purpose="compressed").bytes,
        "sizes": sizes,
    }


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_error_feedback_loses_nothing(world_size, shm):
    steps = 6
    ranks = run_distributed(_feedback, world_size, steps, env={"ZEROTRAIN_SHM": shm})
    first = ranks[0]
    for other in ranks[1:]:  # every rank decodes the same average
        for a, b in zip(first["outputs"], other["outputs"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for b, size in enumerate(first["sizes"]):
        # Sent over all steps + still held in the workers' (averaged) and the servers'
        # errors = the sum of the true averages.
        held = sum(r["worker"][b].double() for r in ranks) / world_size
        chunk = size // world_size
        server = torch.cat([r["server"][b].double() for r in ranks])
        assert server.numel() == size
        assert chunk * world_size == size
        total = first["sent"][b] + held + server
        torch.testing.assert_close(total, first["true"][b], rtol=0, atol=2e-5)
        # The padding never picks up anything.
        real = [sum(n for bb, n in PARAMS if bb == bucket) for bucket in (0, 1)][b]
        assert torch.count_nonzero(first["outputs"][-1][b][real:]) == 0
    # 1 bit per element each way, plus the scales: 2 x 1/8 byte against fp32's 2 x 4.
    elements = sum(first["sizes"])
    volume = first["volume"] / steps
    scales = (len(PARAMS) + 1 + len(PARAMS) + 2) * 4 * world_size
    assert elements / 4 <= volume <= elements / 4 + scales, (volume, elements)


def _exact() -> list[torch.Tensor]:
    comm = Communicator()
    size = padded(64, comm.world_size)
    layout = OneBitLayout(comm.world_size, (size,), (Segment(0, 0, size, 0),))
    # The same magnitude everywhere and the same signs on every rank: 1 bit and one scale
    # per group carry it exactly.
    x = torch.where(torch.arange(size) % 3 == 0, -0.75, 0.75)
    reduce = OneBitAllReduce(comm, layout)
    worker, server = [torch.zeros(size)], [torch.zeros(reduce.server_error_numel(0))]
    buckets = [x.clone()]
    reduce(buckets, worker, server, label="exact")
    return [buckets[0], x, worker[0], server[0]]


def test_values_one_bit_carries_come_through_exactly():
    for out, x, worker, server in run_distributed(_exact, 3):
        assert torch.equal(out, x)
        assert torch.count_nonzero(worker) == 0
        assert torch.count_nonzero(server) == 0

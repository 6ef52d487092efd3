"""Which small units share one collective (``zero/issue.py``) and how their staging is
shared (``shard/staging.py``)."""

from __future__ import annotations

import torch

from zerotrain.shard.io import CollectiveIO
from zerotrain.shard.staging import StagingBatch, StagingPool
from zerotrain.zero.issue import (
    COALESCE_NUMEL,
    batch_all_gathers,
    batch_small_units,
    reduce_batch_numel,
)

SMALL_UNIT_NUMEL = COALESCE_NUMEL // 8


def _runs(sizes, kinds=None, cap=COALESCE_NUMEL):
    return [list(r) for r in batch_small_units(sizes, kinds or ["f32"] * len(sizes), cap)]


def test_runs_of_small_units_share_a_batch_and_a_large_one_goes_alone():
    big = SMALL_UNIT_NUMEL + 1
    assert _runs([10, 20, big, 30, 40, 50]) == [[0, 1], [2], [3, 4, 5]]
    assert _runs([big, big]) == [[0], [1]]
    assert _runs([SMALL_UNIT_NUMEL, 1]) == [[0, 1]]  # the limit itself is small


def test_batches_stop_at_the_coalescing_limit_and_at_a_change_of_kind():
    n = SMALL_UNIT_NUMEL
    per_batch = COALESCE_NUMEL // n
    assert _runs([n] * (per_batch + 1)) == [list(range(per_batch)), [per_batch]]
    assert _runs([1, 2, 3, 4], ["f32", "f32", "bf16", "bf16"]) == [[0, 1], [2, 3]]
    assert _runs([1, 2, 3], ["f32", None, "f32"]) == [[0], [1], [2]]  # None: never batched


def test_reduce_bucket_size_bounds_the_batches():
    assert reduce_batch_numel(None) == COALESCE_NUMEL
    assert reduce_batch_numel(5 * 10**8) == COALESCE_NUMEL  # DeepSpeed's default: capped
    assert reduce_batch_numel(4000) == 4000
    assert _runs([500, 500, 501, 500], cap=4000) == [[0, 1], [2], [3]]  # small: cap // 8
    assert _runs([10, 10], cap=reduce_batch_numel(0)) == [[0], [1]]  # 0: every unit alone


def _gather(numel: int, dtype=torch.float32) -> CollectiveIO:
    out = torch.zeros(2 * numel, dtype=dtype)
    return CollectiveIO("all_gather", out, out[:numel], "parameters", None)


def test_all_gathers_batch_by_output_size_and_dtype():
    ios = [
        _gather(10),
        _gather(20),
        _gather(COALESCE_NUMEL),
        _gather(5),
        _gather(5, torch.bfloat16),
    ]
    assert batch_all_gathers(ios) == [[0, 1], [2], [3], [4]]


def test_a_batch_draws_one_buffer_and_returns_it_when_every_member_is_done():
    pool = StagingPool(16, torch.float32, torch.device("cpu"), count=1)
    batch = StagingBatch(pool, [4, 6])
    first, second = batch.members
    a = first.acquire()
    b = second.acquire()
    assert a is not None
    assert b is not None
    assert (a.numel(), b.numel()) == (4, 6)
    assert b.data_ptr() == a.data_ptr() + 4 * a.element_size()  # side by side
    assert pool.acquire() is None  # the batch holds the pool's only buffer
    first.release(a)
    assert pool.acquire() is None  # one member still holds its slice
    second.release(b)
    again = pool.acquire()
    assert again is not None
    assert again.data_ptr() == a.data_ptr()
    pool.release(again)
    # Slices are views made once per buffer: the same objects on the next pass.
    assert first.acquire() is a

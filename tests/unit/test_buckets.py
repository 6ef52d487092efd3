"""Bucket planning and flattening."""

from __future__ import annotations

import pytest
import torch

from zerotrain.comm.buckets import flatten, plan_buckets, unflatten_into


def test_buckets_hold_whole_tensors_in_order_up_to_the_limit():
    numels = [3, 4, 2, 10, 1, 1, 5]
    buckets = plan_buckets(numels, 8)
    assert [list(b) for b in buckets] == [[0, 1], [2], [3], [4, 5, 6]]
    for bucket in buckets:
        size = sum(numels[i] for i in bucket)
        assert size <= 8 or len(bucket) == 1  # only a lone oversized tensor may exceed


def test_zero_bucket_size_means_one_tensor_per_bucket():
    assert [list(b) for b in plan_buckets([5, 6, 7], 0)] == [[0], [1], [2]]


def test_empty_and_invalid():
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match=">= 0"):
        plan_buckets([1], -1)


def test_flatten_round_trip():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    flat = flatten(tensors)
    assert flat.shape == (12,)
    targets = [torch.zeros_like(t) for t in tensors]
    unflatten_into(flat, targets)
    assert all(torch.equal(a, b) for a, b in zip(tensors, targets, strict=True))
    with pytest.raises(ValueError, match="hold"):
        unflatten_into(flat, targets[:2])

"""One rule for how a reduction splits its averaging, for full and staged gradients."""

from __future__ import annotations

import torch

from zerotrain.config.policies import GradReducePolicy
from zerotrain.shard.grads import divisors

POLICY = GradReducePolicy(bucket_numel=None, overlap=False, pre_divide=2.0, post_divide=8.0)


def test_the_policys_split_where_nothing_narrows():
    assert divisors(POLICY, torch.float32, torch.float32) == (2.0, 8.0)
    assert divisors(POLICY, torch.bfloat16, torch.bfloat16) == (2.0, 8.0)  # staged bf16
    assert divisors(POLICY, torch.bfloat16, torch.float32) == (2.0, 8.0)  # widened: safe


def test_everything_divided_before_a_narrowing_wire():
    # fp32 accumulated over ranks and micro-steps, sent as fp16: the sum could overflow.
    assert divisors(POLICY, torch.float32, torch.float16) == (16.0, 1.0)
    assert divisors(POLICY, torch.float32, torch.bfloat16) == (16.0, 1.0)

"""DeepSpeed's ``checkpointing.configure(mpu, partition_activations=True)`` at 2 ranks: the
kept inputs are split over the mpu's tensor group and gradients are unchanged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotrain import checkpointing
from zerotrain.testing.dist import run_distributed


class _Mpu:
    """Megatron's model-parallel unit, reduced to what DeepSpeed's configure() reads."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.group


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).pow(2)


def _grads(checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # tensor ranks see the same block inputs
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    y = checkpointing.checkpoint(_block, x, w) if checkpointed else _block(x, w)
    y.sum().backward()
    assert x.grad is not None
    assert w.grad is not None
    return x.grad, w.grad


def _partitioned_over_mpu_group() -> None:
    group = dist.new_group([0, 1])
    policy = checkpointing.configure(_Mpu(group), partition_activations=True)
    assert policy.partition_activations
    assert checkpointing.is_configured()
    context = checkpointing.default_context()
    assert context.partition_group is not None
    assert context.partition_group.world_size == 2
    assert context.keeper().partition is context.partition_group
    expected = _grads(checkpointed=False)
    got = _grads(checkpointed=True)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    checkpointing.reset()
    dist.destroy_process_group(group)


def test_configure_with_mpu_partitions_over_its_group() -> None:
    run_distributed(_partitioned_over_mpu_group, 2)

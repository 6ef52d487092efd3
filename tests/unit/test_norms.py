"""Norms of long flat buffers are accurate to fp32 rounding of the fp64 value."""

from __future__ import annotations

import pytest
import torch

from zerotrain.optim.clip import global_grad_norm
from zerotrain.utils.norms import ROW, SHORT, shard_squared_norms, squared_norm


def _ulps_from_fp64(value: torch.Tensor, exact: float) -> float:
    """Distance of fp32 ``value`` from the fp32 rounding of ``exact``, in fp32 ulps."""
    rounded = torch.tensor(exact, dtype=torch.float32)
    ulp = torch.nextafter(rounded, torch.tensor(float("inf"))) - rounded
    return abs(value.float().item() - rounded.item()) / ulp.item()


@pytest.mark.parametrize("numel", [100_000, 1_000_000, 3_300_001, 10_000_000, 100_000_000])
def test_global_norm_of_one_long_buffer_is_within_one_fp32_ulp(numel: int) -> None:
    # Gradient-like values: mostly small with a heavy tail, as one flat buffer of a whole
    # model holds. torch's single fp32 reduction is off by 1e-4 relative at 3.3M elements.
    gen = torch.Generator().manual_seed(numel)
    flat = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow_(4)
    exact = flat.double().norm().item()
    assert _ulps_from_fp64(global_grad_norm([flat]), exact) <= 1.0
    del flat


def test_squared_norm_edges() -> None:
    assert squared_norm(torch.empty(0)).item() == 0.0
    short = torch.arange(1, ROW // 2, dtype=torch.float32)  # only a tail, no whole row
    assert squared_norm(short).item() == pytest.approx(float((short.double() ** 2).sum()))
    grid = torch.randn(37, ROW + 3).t()  # not contiguous: reshaped, not viewed
    assert squared_norm(grid).dtype == torch.float64
    assert squared_norm(grid).item() == pytest.approx(float(grid.double().square().sum()), rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_squared_norm_of_16_bit_values_is_taken_in_fp32(dtype: torch.dtype) -> None:
    values = (torch.randn(5 * ROW + 7) * 300).to(dtype)  # squares overflow fp16
    exact = float(values.double().square().sum())
    assert squared_norm(values).item() == pytest.approx(exact, rel=5e-7)  # fp32 rows


def test_norm_of_many_tensors_and_infinities() -> None:
    parts = [torch.randn(n) for n in (3, ROW, 5 * ROW + 1)]
    exact = torch.cat(parts).double().norm().item()
    assert _ulps_from_fp64(global_grad_norm(parts), exact) <= 1.0
    parts[1][7] = float("inf")
    assert not torch.isfinite(global_grad_norm(parts))
    parts[1][7] = float("nan")
    assert torch.isnan(global_grad_norm(parts))
    assert global_grad_norm([]).item() == 0.0


def test_shard_norms_are_exact_and_do_not_depend_on_their_companions() -> None:
    """The global norm's per-shard sums: short shards in fp64 (within 1e-13), one
    foreach reduction for all of them, and the same value whether a shard is taken alone
    (a slice in a swap file, as it is written) or with the others."""
    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(n, generator=gen) * 100 for n in (1, 1000, SHORT, SHORT + 1, 3 * ROW + 5)]
    shards.append((torch.randn(2000, generator=gen) * 300).to(torch.float16))  # squares overflow
    shards.append(torch.empty(0))
    together = shard_squared_norms(shards)
    for shard, square in zip(shards, together, strict=True):
        assert square.dtype == torch.float64
        assert torch.equal(square, shard_squared_norms([shard])[0])
        exact = float(shard.double().square().sum())
        rel = 1e-13 if shard.numel() <= SHORT else 5e-7  # long ones: squared_norm's rows
        assert square.item() == pytest.approx(exact, rel=rel, abs=0.0)
    assert together[-2].item() > 65504.0  # no fp16 overflow

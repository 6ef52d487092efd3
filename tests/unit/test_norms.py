"""Norms of long flat buffers are accurate to fp32 rounding of the fp64 value."""

from __future__ import annotations

import pytest
import torch

from zerotrain.optim.clip import global_grad_norm
from zerotrain.utils.norms import ROW, squared_norm


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

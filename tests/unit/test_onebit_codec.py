"""The 1-bit codec in one process: packing, padding, layouts, and what compression drops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zerotrain.comm.onebit import (
    OneBitLayout,
    Segment,
    alignment,
    compress,
    pack_signs,
    padded,
    unpack_signs,
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 8, 12])
def test_alignment_is_n_times_lcm_n_8(world_size):
    assert alignment(world_size) == world_size * math.lcm(world_size, 8)
    for numel in (1, 7, 8, 9, 1000, 12345):
        p = padded(numel, world_size)
        assert p >= numel
        assert p % world_size == 0
        assert (p // world_size) % 8 == 0
        assert p - numel < alignment(world_size)


@pytest.mark.parametrize("numel", [1, 5, 8, 13, 100, 1001])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_signs_round_trip_for_any_length_once_padded(numel, world_size):
    values = torch.randn(numel)
    values[::7] = 0.0  # zero counts as +1
    full = torch.zeros(padded(numel, world_size))
    full[:numel] = values
    packed = pack_signs(full)
    assert packed.dtype == torch.uint8
    assert packed.numel() == full.numel() // 8
    signs = unpack_signs(packed)
    assert torch.equal(signs, torch.where(full >= 0, 1.0, -1.0))
    # Each server chunk packs on its own into whole bytes: the rows the all-to-all sends.
    chunk = full.numel() // world_size
    rows = [pack_signs(full[j * chunk : (j + 1) * chunk]) for j in range(world_size)]
    assert torch.equal(torch.cat(rows), packed)


def test_the_torch_op_path_packs_like_numpy():
    # The accelerator path (torch ops) must produce NumPy's bit order; the meta device
    # cannot compute, so the torch ops run on CPU tensors through the same expressions.
    values = torch.randn(4096)
    bits = (values >= 0).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    by_torch = (bits * weights).sum(dim=1, dtype=torch.uint8)
    assert torch.equal(by_torch, torch.from_numpy(np.packbits(values.numpy() >= 0)))
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8)
    back = ((by_torch.view(-1, 1) >> shifts) & 1).view(-1).float() * 2 - 1
    assert torch.equal(back, unpack_signs(by_torch))


def test_what_compression_drops_is_exactly_the_error():
    x = torch.randn(1000) * torch.linspace(0.1, 3.0, 1000)
    scale = x.norm() / math.sqrt(x.numel())
    kept = compress(x, scale)
    assert torch.equal(kept.abs(), torch.full_like(x, float(scale)))
    assert torch.equal(torch.sign(kept), torch.where(x >= 0, 1.0, -1.0))
    error = x - kept
    # What is kept plus what is carried to the next step is the input, to rounding.
    torch.testing.assert_close(kept + error, x, rtol=0, atol=4 * torch.finfo(torch.float32).eps)


def test_layout_checks_cover_and_alignment():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        OneBitLayout(4, (100,), (Segment(0, 0, 100, 0),))
    with pytest.raises(Exception, match="cover"):
        OneBitLayout(2, (16,), (Segment(0, 0, 8, 0),))
    layout = OneBitLayout(
        2, (32, 16), (Segment(0, 0, 20, 0), Segment(0, 20, 32, 1), Segment(1, 0, 16, 1))
    )
    assert layout.groups == 2
    assert layout.chunk(0, 1) == (16, 32)
    assert layout.packed_row == 2 + 1
    # Rank 0 serves [0, 16) of bucket 0 (group 0) and [0, 8) of bucket 1 (group 1).
    assert layout.server_segments(0) == [Segment(0, 0, 16, 0), Segment(1, 0, 8, 1)]
    assert layout.server_segments(1) == [
        Segment(0, 16, 20, 0),
        Segment(0, 20, 32, 1),
        Segment(1, 8, 16, 1),
    ]
    assert layout.max_server_segments == 3

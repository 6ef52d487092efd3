"""zero.Init records construction on its own: no process group, nothing left patched."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.zero.init import deferred_values


def test_init_needs_no_process_group_and_restores_what_it_redirected():
    was_initialized = dist.is_initialized()
    new, normal = nn.Parameter.__new__, nn.init.normal_
    with zerotrain.zero.Init():
        model = nn.Linear(4, 3)
        assert nn.Parameter.__new__ is not new  # redirected inside only
    assert dist.is_initialized() == was_initialized
    assert nn.Parameter.__new__ is new
    assert nn.init.normal_ is normal
    assert all(p.is_meta for p in model.parameters())
    # No attribute is hung on the parameters: recipes live in a side table.
    assert not [k for p in model.parameters() for k in vars(p) if k.startswith("_zerotrain")]
    values = deferred_values(model)
    assert values is not None
    torch.manual_seed(0)
    assert values(model.weight).shape == (3, 4)


def test_a_failure_inside_init_restores_everything():
    new = nn.Parameter.__new__

    def build_then_fail() -> None:
        with zerotrain.zero.Init():
            nn.Linear(2, 2)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_then_fail()
    assert nn.Parameter.__new__ is new

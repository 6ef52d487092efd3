"""FLOP formulas that PyTorch's ``FlopCounterMode`` registry lacks, in its own conventions."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter


def missing_formulas() -> dict[Any, Any]:
    """FLOP formulas for the CPU attention kernels, which PyTorch's registry lacks.

    On CPU ``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
    which ``FlopCounterMode`` does not know and counts as 0. We give it PyTorch's own formulas
    for the CUDA kernels, so CPU and GPU counts agree: dense (a causal mask is not discounted)
    and a backward of 2.5x the forward (it recomputes the scores).
    """
    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    fwd = "_scaled_dot_product_flash_attention_for_cpu"
    bwd = "_scaled_dot_product_flash_attention_for_cpu_backward"
    if hasattr(aten, fwd) and getattr(aten, fwd) not in flop_counter.flop_registry:
        mapping[getattr(aten, fwd)] = _cpu_sdpa_flop
    if hasattr(aten, bwd) and getattr(aten, bwd) not in flop_counter.flop_registry:
        mapping[getattr(aten, bwd)] = _cpu_sdpa_backward_flop
    return mapping


def _cpu_sdpa_flop(
    query: torch.Size, key: torch.Size, value: torch.Size, *_: Any, **__: Any
) -> int:
    return int(flop_counter.sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward_flop(
    grad_out: torch.Size, query: torch.Size, key: torch.Size, value: torch.Size, *_: Any, **__: Any
) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value))

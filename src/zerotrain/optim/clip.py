"""Gradient clipping by global norm over flat gradient tensors.

Matches ``torch.nn.utils.clip_grad_norm_``: coefficient ``max_norm / (norm + 1e-6)``, capped
at 1. When each rank holds only part of the gradients (ZeRO stages >= 2), the caller passes
``reduce_partial`` to sum the squared partial norms across ranks; this module knows nothing
of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

PartialReducer = Callable[[torch.Tensor], None]


def global_grad_norm(
    grads: Sequence[torch.Tensor], reduce_partial: PartialReducer | None = None
) -> torch.Tensor:
    """L2 norm of all ``grads`` together (0-d fp32 tensor)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return combine_norms(torch._foreach_norm(list(grads)), reduce_partial)


def combine_norms(
    norms: Sequence[torch.Tensor], reduce_partial: PartialReducer | None = None
) -> torch.Tensor:
    """L2 norm of tensors whose own norms are ``norms`` (0-d each, in a fixed order: the
    sum is then bitwise the same wherever the norms were taken)."""
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    squares = torch.stack([n.float() for n in norms]).square().sum()
    if reduce_partial is not None:
        reduce_partial(squares)
    return squares.sqrt()


def clip_grads_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    reduce_partial: PartialReducer | None = None,
) -> torch.Tensor:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``.

    Returns the norm before clipping. ``max_norm <= 0`` only measures.
    """
    total = global_grad_norm(grads, reduce_partial)
    if max_norm > 0 and grads:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    return total


def unscale_and_clip_(
    grads: Sequence[torch.Tensor], scaled_norm: torch.Tensor, inv_scale: float, max_norm: float
) -> torch.Tensor:
    """Divide loss-scaled ``grads`` by the scale and clip them to ``max_norm`` (if > 0) in
    one multiplication, given their global norm ``scaled_norm``; returns the unscaled norm.

    The coefficient is the one ``clip_grads_`` uses on the unscaled gradients, so clipping
    acts on true gradient norms whatever the loss scale.
    """
    total, coef = clip_coefficient(scaled_norm, inv_scale, max_norm)
    if grads and coef is not None:
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    return total


def clip_coefficient(
    scaled_norm: torch.Tensor, inv_scale: float, max_norm: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(unscaled norm, factor)``: what ``unscale_and_clip_`` multiplies the gradients by
    (None: nothing to do), for callers that apply it themselves as they stream gradients."""
    total = scaled_norm * inv_scale
    coef = torch.full_like(total, inv_scale)
    if max_norm > 0:
        coef = coef * (max_norm / (total + 1e-6)).clamp(max=1.0)
    elif inv_scale == 1.0:
        return total, None
    return total, coef

"""The global gradient norm and the clip coefficient, over flat gradient tensors.

Matches ``torch.nn.utils.clip_grad_norm_``: coefficient ``max_norm / (norm + 1e-6)``, capped
at 1. Norms come from ``optim.norms`` (accurate to fp32 rounding however long the flat
buffers are) and are combined as fp64 squares. When gradients are spread over ranks (ZeRO
stages >= 1, or other parallel axes), the caller passes ``reduce_partial`` to sum the fp64
squares across them; this module knows nothing of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zerotrain.utils.norms import squared_norms, sum_squares

PartialReducer = Callable[[torch.Tensor], None]


def global_grad_norm(
    grads: Sequence[torch.Tensor], reduce_partial: PartialReducer | None = None
) -> torch.Tensor:
    """L2 norm of all ``grads`` together (0-d fp32)."""
    return norm_from_squares(squared_norms(grads), reduce_partial)


def norm_from_squares(
    squares: Sequence[torch.Tensor], reduce_partial: PartialReducer | None = None
) -> torch.Tensor:
    """L2 norm (0-d fp32) of tensors whose sums of squares are ``squares`` (0-d fp64 each, in
    a fixed order: the total is then bitwise the same wherever they were taken), summed over
    ranks by ``reduce_partial`` (in place, fp64) when given."""
    total = sum_squares(squares)
    if reduce_partial is not None:
        reduce_partial(total)
    return total.sqrt().float()


def clip_coefficient(
    scaled_norm: torch.Tensor, inv_scale: float, max_norm: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(unscaled norm, factor)``: what the reduced gradients are multiplied by to undo the
    loss scale and clip them to ``max_norm`` (if > 0) in one pass (None: nothing to do).

    The factor is the one ``clip_grad_norm_`` uses on the unscaled gradients, so clipping
    acts on true gradient norms whatever the loss scale.
    """
    total = scaled_norm * inv_scale
    coef = torch.full_like(total, inv_scale)
    if max_norm > 0:
        coef = coef * (max_norm / (total + 1e-6)).clamp(max=1.0)
    elif inv_scale == 1.0:
        return total, None
    return total, coef

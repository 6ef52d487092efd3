"""LAMB (You et al., 2019) on flat tensors that pack many parameters.

LAMB scales each parameter's Adam-style update by a trust ratio ``||w|| / ||update||``
computed per *original* parameter, so the optimizer needs to know where each parameter sits
inside a flat tensor: every param group carries ``segments``, one tuple of ``(start, end)``
spans per flat tensor. When a parameter is split across ranks (ZeRO stages >= 1), each rank
holds part of it; ``norm_reducer`` then sums the partial squared norms across ranks. The
optimizer itself knows nothing of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zerotrain.optim.base import FlatOptimizer

NormReducer = Callable[[torch.Tensor], None]


def _pieces(segments: Sequence[tuple[int, int]], numel: int) -> tuple[list[int], list[bool]]:
    """Lengths covering ``[0, numel)`` in order, and whether each piece is a real segment."""
    lengths: list[int] = []
    real: list[bool] = []
    position = 0
    for start, end in sorted(segments):
        if start > position:
            lengths.append(start - position)
            real.append(False)
        lengths.append(end - start)
        real.append(True)
        position = end
    if position < numel:
        lengths.append(numel - position)
        real.append(False)
    return lengths, real


class Lamb(FlatOptimizer):
    """LAMB with DeepSpeed's options.

    Args:
        params: param-group dicts with ``params`` (flat tensors) and ``segments``.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator (inside the square root if ``eps_inside_sqrt``).
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - beta**t``.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        eps_inside_sqrt: use ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        norm_reducer: sums a tensor of partial squared norms across ranks in place (sharded
            parameters); None when every parameter is whole on this rank.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
            "eps_inside_sqrt": eps_inside_sqrt,
        }
        self._norm_reducer = norm_reducer
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            segments = group.get("segments")
            if segments is None or len(segments) != len(group["params"]):
                raise ValueError(
                    f"Lamb param group {i} needs 'segments': one list of (start, end) spans per "
                    "flat tensor, so trust ratios are computed per original parameter"
                )

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        spans = {id(p): s for p, s in zip(group["params"], group["segments"], strict=True)}
        for param in params:
            self._step_tensor(param, param.grad, spans[id(param)], group)  # type: ignore[arg-type]

    def _step_tensor(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        segments: Sequence[tuple[int, int]],
        group: dict[str, Any],
    ) -> None:
        state = self.state[param]
        state["step"] += 1
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1 = 1 - beta1 ** state["step"] if group["bias_correction"] else 1.0
        bc2 = 1 - beta2 ** state["step"] if group["bias_correction"] else 1.0
        if group["eps_inside_sqrt"]:
            denom = (v / bc2).add_(group["eps"]).sqrt_()
        else:
            denom = (v / bc2).sqrt_().add_(group["eps"])
        update = (m / bc1).div_(denom)
        del denom
        if group["weight_decay"] != 0:
            update.add_(param, alpha=group["weight_decay"])

        lengths, real = _pieces(segments, param.numel())
        p_pieces = [t for t, r in zip(param.view(-1).split(lengths), real, strict=True) if r]
        u_pieces = [t for t, r in zip(update.view(-1).split(lengths), real, strict=True) if r]
        squares = torch.stack(
            [torch.stack(torch._foreach_norm(p_pieces)), torch.stack(torch._foreach_norm(u_pieces))]
        ).square_()
        if self._norm_reducer is not None:
            self._norm_reducer(squares)
        w_norm, u_norm = squares.sqrt_().unbind(0)
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        trust.clamp_(group["min_coeff"], group["max_coeff"])
        # Padding between/after segments gets coefficient 0: it is never updated.
        per_piece = torch.zeros(len(lengths), dtype=trust.dtype, device=trust.device)
        per_piece[torch.tensor(real, device=trust.device)] = trust
        coeff = torch.repeat_interleave(
            per_piece, torch.tensor(lengths, device=trust.device), output_size=param.numel()
        )
        param.view(-1).addcmul_(coeff, update.view(-1), value=-group["lr"])

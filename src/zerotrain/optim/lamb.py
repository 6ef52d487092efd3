"""LAMB on flat tensors that pack many parameters, with DeepSpeed's ``Lamb`` semantics.

For each original parameter w with moments m, v (not bias-corrected)::

    update = m / (sqrt(v) + eps) + weight_decay * w          (sqrt(v + eps) if eps_inside_sqrt)
    trust  = clamp(||w|| / ||update||, min_coeff, max_coeff)  (1 if either norm is 0)
    w     -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * trust * update

which is what DeepSpeed's fused kernel computes, so a learning rate tuned there carries over.

Norms are per *original* parameter, so every param group carries ``segments``: for each flat
tensor, the ``(start, end, id)`` spans of the parameters (or parameter fragments) inside it,
where ``id`` names the parameter and ``num_ids`` bounds the ids. When parameters are split
across ranks (ZeRO stages >= 1), each rank holds fragments; ``norm_reducer`` sums the
partial squared norms of a whole group across ranks in one collective. The optimizer itself
knows nothing of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zerotrain.optim.base import FlatOptimizer
from zerotrain.utils.norms import squared_norms

NormReducer = Callable[[torch.Tensor], None]
Segment = tuple[int, int, int]  # (start, end, parameter id) inside one flat tensor


def segment_runs(segments: Sequence[Segment], numel: int) -> tuple[list[int], list[int]]:
    """Lengths covering ``[0, numel)`` in order, and the parameter id of each (-1: padding)."""
    lengths: list[int] = []
    ids: list[int] = []
    position = 0
    for start, end, pid in sorted(segments):
        if start > position:
            lengths.append(start - position)
            ids.append(-1)
        lengths.append(end - start)
        ids.append(pid)
        position = end
    if position < numel:
        lengths.append(numel - position)
        ids.append(-1)
    return lengths, ids


class Lamb(FlatOptimizer):
    """LAMB with DeepSpeed's options.

    Args:
        params: param-group dicts with ``params`` (flat tensors), ``segments`` (one list of
            ``(start, end, id)`` per tensor) and ``num_ids`` (ids are ``0 .. num_ids - 1``).
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator (inside the square root if ``eps_inside_sqrt``).
        weight_decay: added to the update (times the weight) before the trust ratio.
        bias_correction: scale the step by ``sqrt(1 - beta2^t) / (1 - beta1^t)``.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        eps_inside_sqrt: use ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        norm_reducer: sums a ``(2, num_ids)`` tensor of partial squared norms across ranks in
            place; None when every parameter is whole on this rank.
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
            if segments is None or len(segments) != len(group["params"]) or "num_ids" not in group:
                raise ValueError(
                    f"Lamb param group {i} needs 'segments' (one list of (start, end, id) per "
                    "flat tensor) and 'num_ids', so trust ratios are computed per parameter"
                )

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": 0,
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        spans = {id(p): s for p, s in zip(group["params"], group["segments"], strict=True)}
        device = params[0].device
        # Pass 1: moments, updates and partial squared norms per parameter id.
        # fp64 squares from row-wise norms: a parameter's piece can be millions of elements,
        # where one fp32 reduction is off by ~1e-4 (see utils/norms.py).
        squares = torch.zeros(2, group["num_ids"], dtype=torch.float64, device=device)
        work = []
        for param in params:
            state = self.state[param]
            state["step"] += 1
            grad = param.grad
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if group["eps_inside_sqrt"]:
                denom = v.add(group["eps"]).sqrt_()
            else:
                denom = v.sqrt().add_(group["eps"])
            update = m.div(denom)
            del denom
            if group["weight_decay"] != 0:
                update.add_(param, alpha=group["weight_decay"])
            lengths, ids = segment_runs(spans[id(param)], param.numel())
            real = [i for i, pid in enumerate(ids) if pid >= 0]
            index = torch.tensor([ids[i] for i in real], dtype=torch.long, device=device)
            for row, tensor in enumerate((param, update)):
                if not real:
                    break  # padding only (or an empty placeholder): no norm to add
                pieces = tensor.view(-1).split(lengths)
                piece_squares = squared_norms([pieces[i] for i in real])
                squares[row].index_add_(0, index, torch.stack(piece_squares))
            work.append((param, update, lengths, ids, state["step"]))
        if self._norm_reducer is not None:
            self._norm_reducer(squares)
        w_norm, u_norm = squares.sqrt().float().unbind(0)
        ratio = (w_norm / u_norm).clamp_(group["min_coeff"], group["max_coeff"])
        trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        # Pass 2: apply. Padding gets coefficient 0 and is never updated.
        for param, update, lengths, ids, step in work:
            if param.numel() == 0:
                continue  # a placeholder: it only took part in the norm reduction
            step_size = group["lr"]
            if group["bias_correction"]:
                step_size *= math.sqrt(1 - beta2**step) / (1 - beta1**step)
            padded = torch.cat([trust, torch.zeros(1, dtype=trust.dtype, device=device)])
            per_piece = padded[torch.tensor(ids, dtype=torch.long, device=device)]
            coeff = torch.repeat_interleave(
                per_piece.to(param.dtype),
                torch.tensor(lengths, device=device),
                output_size=param.numel(),
            )
            param.view(-1).addcmul_(coeff, update.view(-1), value=-step_size)

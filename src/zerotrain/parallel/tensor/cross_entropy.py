"""Cross-entropy over logits whose vocabulary is split over the tensor group.

The whole logits never exist on one rank. Each rank holds ``V/t`` columns; the softmax's
maximum and sum of exponentials, and the target's logit (held by one rank), are reduced over
the group: three small all-reduces of ``b * s`` values instead of an all-gather of
``b * s * V``. Backward needs no communication: the gradient of the loss with respect to
this rank's logits is its slice of ``softmax - onehot(target)``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.comm.collectives import Communicator


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Communicator
    ) -> torch.Tensor:
        local = logits.float()
        peak = local.max(dim=-1).values
        comm.all_reduce(peak, purpose="activations", op="max")
        shifted = local - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce(total, purpose="activations")
        vocab = local.shape[-1]
        start = comm.rank * vocab
        outside = (target < start) | (target >= start + vocab)
        index = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(picked, purpose="activations")
        softmax = exp / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, outside)
        ctx.dtype = logits.dtype
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, index, outside = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, index.unsqueeze(-1), 1.0)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        return ((softmax - onehot) * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Communicator
) -> torch.Tensor:
    """Per-position cross-entropy (unreduced: ``target``'s shape) of logits split over
    ``comm`` along the last dimension (rank r holds classes ``[r * V/t, (r + 1) * V/t)``).
    Take ``.mean()`` for ``F.cross_entropy``'s default."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
            f"{tuple(target.shape)} must agree in every dimension but the last"
        )
    result: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, comm)
    return result

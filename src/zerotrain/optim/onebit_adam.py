"""1-bit Adam (Tang et al., 2021), with DeepSpeed's semantics.

* **Warm-up** (``freeze_step`` steps): Adam on the averaged gradients, written as DeepSpeed
  writes it. Kept from DeepSpeed on purpose, so a tuned learning rate carries over:
  the first step only initialises (moments updated, parameters left as they are); no bias
  correction (``bias_correction`` is accepted and has no effect, there as here); weight
  decay is added to the update (``w -= lr * (m / (sqrt(v) + eps) + wd * w)``).
* **Compression** (afterwards): the engine stops averaging gradients. Each rank folds its
  own gradient into the momentum, the momentum is averaged with the 1-bit compressed
  all-reduce (error feedback on both sides), and the variance stays frozen. One scale per
  parameter, as DeepSpeed compresses each parameter on its own.

ZeRO stage 1: the variance and the server error exist only for this rank's shard, the
momentum and worker error in full (every rank needs all of the momentum to fold its
gradient in); the update is applied to the shard and the engine all-gathers the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from zerotrain.optim.compressed import Bucket, CompressedOptimizer, Exchange, adam_update


class OneBitAdam(CompressedOptimizer):
    """1-bit Adam over this rank's pieces.

    Args:
        params: param groups of the pieces' tensors.
        buckets: the units (see ``Bucket``).
        exchange: the collectives over the data-parallel group.
        lr, betas, eps, weight_decay: as Adam.
        freeze_step: steps of uncompressed warm-up (the variance is frozen after them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        buckets: Sequence[Bucket],
        exchange: Exchange,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, buckets, exchange, defaults, {"step": 0})
        self.freeze_step = freeze_step

    def wants_averaged_gradients(self) -> bool:
        """Averaged gradients until the warm-up ends. As in DeepSpeed, the first step (an
        initialisation) never ends it, so compression starts at step
        ``max(freeze_step, 2) + 1``."""
        return self.steps < max(self.freeze_step, 2)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: warm-up Adam, or the compressed momentum exchange."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = not self.wants_averaged_gradients()
        step = self._count_step()
        if compressed:
            self._compressed_step()
        else:
            self._warmup_step(update=step > 1)
        return loss

    def _warmup_step(self, update: bool) -> None:
        for bucket in self.buckets:
            for piece, group in self.groups_of(bucket):
                grad = piece.param.grad
                if grad is None:
                    continue
                state = self.piece_state(piece)
                if not state:
                    state["exp_avg"] = torch.zeros_like(piece.param)
                    state["exp_avg_sq"] = torch.zeros_like(piece.param)
                beta1, beta2 = group["betas"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if update:
                    piece.param.add_(adam_update(piece.param, m, v, group), alpha=-group["lr"])

    def _compressed_step(self) -> None:
        momenta = self._momenta()
        self._fold_gradients(momenta)
        self._average(momenta, "momentum")
        for bucket in self.buckets:
            for piece, group in self.groups_of(bucket):
                state = self.piece_state(piece)
                # A parameter that never had a gradient in the warm-up has no variance yet
                # (zero, as DeepSpeed initialises it).
                v = state.setdefault("exp_avg_sq", torch.zeros_like(piece.param))
                piece.param.add_(
                    adam_update(piece.param, state["exp_avg"], v, group), alpha=-group["lr"]
                )

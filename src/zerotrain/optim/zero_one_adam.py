"""0/1 Adam (Lu et al., 2022), with DeepSpeed's semantics.

Its own control flow, in two phases after a first step that only initialises:

* **Variance updates** (while ``step <= var_freeze_step``). The variance is updated only on
  steps that are multiples of ``var_interval``, whose gradients the engine averages in full
  precision; on the others each rank's gradient is averaged with the 1-bit compressed
  all-reduce and only the momentum moves. ``var_interval`` starts at 1 and doubles after
  every ``var_update_scaler`` variance updates.
* **Local steps** (afterwards; the variance frozen). Each rank steps on its own gradient and
  accumulates what it moved; every ``local_step_interval`` steps the ranks average the
  accumulated moves (compressed) and restart from the common point, with the momentum
  rebuilt from the average. ``local_step_interval`` doubles every ``local_step_scaler`` steps
  up to ``local_step_clipper``.

As in DeepSpeed: no bias correction, weight decay added to the update, one scale per
parameter in the compression, and the error feedback zeroed when the local steps begin.
ZeRO stage 0 only: every rank updates all of its parameters with the frozen variance at
every local step, so neither can be partitioned (``engine/compressed_setup.py`` refuses
stage 1 and says so).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from zerotrain.optim.compressed import Bucket, CompressedOptimizer, Exchange, adam_update

_COUNTERS = {
    "step": 0,
    "var_interval": 1,
    "var_counter": 0,
    "local_step_interval": 1,
    "local_step_counter": 0,
    "lrs": 0.0,  # learning rates summed since the last synchronisation (per group)
    "errors_reset": False,  # the error feedback was zeroed when local steps began
}


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam over the buckets (ZeRO stage 0: the pieces are whole buckets).

    Args:
        params: param groups of the pieces' tensors.
        buckets: the units (see ``Bucket``).
        exchange: the collectives over the data-parallel group.
        lr, betas, eps, weight_decay: as Adam.
        var_freeze_step: the last step that may update the variance.
        var_update_scaler: variance updates between doublings of their interval.
        local_step_scaler: steps between doublings of the local-step interval.
        local_step_clipper: the largest local-step interval.
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
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, buckets, exchange, defaults, dict(_COUNTERS))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.accumulators: list[torch.Tensor] = []  # moves since the last synchronisation

    # -- schedule ---------------------------------------------------------------------------------

    def _counter(self, key: str) -> Any:
        return self.param_groups[0][key]

    def _set(self, key: str, value: Any) -> None:
        for group in self.param_groups:
            group[key] = value

    @property
    def local_steps(self) -> bool:
        """Whether the variance is frozen and the ranks take local steps."""
        return self.steps > self.var_freeze_step

    def wants_averaged_gradients(self) -> bool:
        """Averaged gradients on the variance steps only (the first step, an initialisation,
        uses none)."""
        if self.steps == 0 or self.local_steps:
            return False
        return (self.steps + 1) % self._counter("var_interval") == 0

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of whichever phase the schedule is in."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local = self.local_steps
        step = self._count_step()
        momenta = self._momenta()
        for bucket in self.buckets:
            for piece in bucket.pieces:
                self.piece_state(piece).setdefault("exp_avg_sq", torch.zeros_like(piece.param))
        if step == 1:
            return loss  # an initialisation step, as in DeepSpeed
        if local:
            self._local_step(step, momenta)
        else:
            self._variance_phase_step(step, momenta)
        if self.local_steps and not self._counter("errors_reset"):
            self.zero_errors()  # the local steps start with a clean error feedback
            self._set("errors_reset", True)
        return loss

    def _variance_phase_step(self, step: int, momenta: list[torch.Tensor]) -> None:
        interval = self._counter("var_interval")
        if step % interval == 0:  # the engine averaged this step's gradients
            self._fold_gradients(momenta)
            for bucket in self.buckets:
                grad = bucket.gradient()
                for piece, group in self.groups_of(bucket):
                    g = grad[piece.start : piece.stop]
                    beta2 = group["betas"][1]
                    self.piece_state(piece)["exp_avg_sq"].mul_(beta2).addcmul_(
                        g, g, value=1 - beta2
                    )
            counter = self._counter("var_counter") + 1
            if counter == self.var_update_scaler:
                counter, interval = 0, interval * 2
            self._set("var_counter", counter)
            self._set("var_interval", interval)
        else:  # each rank's own gradient, averaged compressed
            grads = [bucket.gradient() for bucket in self.buckets]
            self._average(grads, "gradients")
            for bucket, m, g in zip(self.buckets, momenta, grads, strict=True):
                for start, end, index in bucket.groups:
                    beta1 = self.param_groups[index]["betas"][0]
                    m[start:end].mul_(beta1).add_(g[start:end], alpha=1 - beta1)
        self._apply(momenta, accumulate=False)

    def _local_step(self, step: int, momenta: list[torch.Tensor]) -> None:
        if not self.accumulators:
            self.accumulators = self._full()
        self._fold_gradients(momenta)  # this rank's own gradient
        for group in self.param_groups:
            group["lrs"] += group["lr"]
        self._apply(momenta, accumulate=True)
        if step % self._counter("local_step_interval") == 0:
            self._synchronise(momenta)
        counter = self._counter("local_step_counter") + 1
        interval = self._counter("local_step_interval")
        if counter == self.local_step_scaler:
            counter, interval = 0, min(self.local_step_clipper, interval * 2)
        self._set("local_step_counter", counter)
        self._set("local_step_interval", interval)

    def _apply(self, momenta: list[torch.Tensor], accumulate: bool) -> None:
        """``w -= lr * update`` on every piece (and the move into the accumulator)."""
        for b, bucket in enumerate(self.buckets):
            for piece, group in self.groups_of(bucket):
                state = self.piece_state(piece)
                update = adam_update(piece.param, state["exp_avg"], state["exp_avg_sq"], group)
                update.mul_(-group["lr"])
                piece.param.add_(update)
                if accumulate:
                    self.accumulators[b][piece.start : piece.stop].add_(update)

    def _synchronise(self, momenta: list[torch.Tensor]) -> None:
        """Back to the common point, then forward by the ranks' averaged move; the momentum
        becomes the average move expressed as one (DeepSpeed's reconstruction)."""
        for b, bucket in enumerate(self.buckets):
            moved = self.accumulators[b]
            for piece, group in self.groups_of(bucket):
                part = moved[piece.start : piece.stop]
                piece.param.sub_(part)
                part.mul_(self.piece_state(piece)["exp_avg_sq"].sqrt().add_(group["eps"]))
        self._average(self.accumulators, "local steps")
        for b, bucket in enumerate(self.buckets):
            moved = self.accumulators[b]
            for piece, group in self.groups_of(bucket):
                state = self.piece_state(piece)
                part = moved[piece.start : piece.stop]
                state["exp_avg"].copy_(part).div_(-group["lrs"])
                piece.param.add_(part / state["exp_avg_sq"].sqrt().add_(group["eps"]))
            moved.zero_()
        self._set("lrs", 0.0)

    def state_tensors(self) -> list[torch.Tensor]:
        """The buffers kept beside ``self.state``, with the accumulated local moves."""
        return [*super().state_tensors(), *self.accumulators]

    # -- rank-local state -------------------------------------------------------------------------

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """The error feedback, this rank's momentum (its own between synchronisations), its
        accumulated local moves and, during local steps, its own parameters (the
        checkpoint's shared copy holds pieces of every rank's)."""
        out = super().rank_local_state()
        for i, m in enumerate(self.momenta):
            out[f"momentum.{i}"] = m
        for i, a in enumerate(self.accumulators):
            out[f"moved.{i}"] = a
        if self.local_steps:
            for b, bucket in enumerate(self.buckets):
                for k, piece in enumerate(bucket.pieces):
                    out[f"param.{b}.{k}"] = piece.param
        return out

    def load_rank_local_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Restore them (same layout); otherwise the momentum comes from the checkpoint's
        shared copy and the accumulated moves start from zero."""
        super().load_rank_local_state(tensors)
        self.accumulators = []
        if not tensors:
            return
        if "momentum.0" in tensors:
            momenta = self._momenta()
            for i, m in enumerate(momenta):
                m.copy_(tensors[f"momentum.{i}"])
        if "moved.0" in tensors:
            self.accumulators = self._full()
            for i, a in enumerate(self.accumulators):
                a.copy_(tensors[f"moved.{i}"])
        for b, bucket in enumerate(self.buckets):
            for k, piece in enumerate(bucket.pieces):
                own = tensors.get(f"param.{b}.{k}")
                if own is not None:
                    piece.param.copy_(own)

"""1-bit LAMB (Li et al., 2021), with DeepSpeed's semantics.

* **Warm-up** (``freeze_step`` steps, after a first step that only initialises): LAMB on the
  averaged gradients, without bias correction, with weight decay in the update and the
  trust ratio ``clamp(||w|| / ||update||, min_coeff, max_coeff)``. Each parameter's ratios
  are averaged into ``lamb_coeff_freeze`` (an exponential average, ``coeff_beta``), and the
  variance is copied into a *fresh variance* at step ``freeze_step``.
* **Compression** (afterwards): the variance is frozen and the momentum of the whole model
  is averaged as one buffer with the 1-bit compressed all-reduce (one scale), each
  parameter's momentum multiplied first by a *scaling coefficient* that brings every
  parameter to the same average magnitude (fixed at the first compressed step). The
  gradient implied by the new momentum updates the fresh variance, and the trust ratio is
  ``lamb_coeff_freeze`` times a factor, the largest ratio of the frozen to the fresh
  denominator over the parameter, clamped to ``[factor_min, factor_max]`` and to within
  ``factor_threshold`` of the previous factor.

Per-parameter values (``lamb_coeff_freeze``, the last factor, the scaling coefficients) are
indexed by parameter id and kept in the first param group, so checkpoints carry them to any
layout. At ZeRO stage 1 parameters are split across ranks: norms and maxima over a
parameter are reduced across its shards through the exchange.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from zerotrain.optim.compressed import Bucket, CompressedOptimizer, Exchange, Piece, adam_update
from zerotrain.optim.lamb import segment_runs
from zerotrain.utils.norms import squared_norm


class OneBitLamb(CompressedOptimizer):
    """1-bit LAMB over this rank's pieces.

    Args:
        params: param groups of the pieces' tensors.
        buckets: the units (see ``Bucket``).
        exchange: the collectives over the data-parallel group.
        num_ids: parameter ids run ``0 .. num_ids - 1``.
        lr, betas, eps, weight_decay: as LAMB.
        freeze_step: steps of uncompressed warm-up.
        max_coeff, min_coeff: clamp of the warm-up trust ratio.
        coeff_beta: averaging of the warm-up trust ratios into ``lamb_coeff_freeze``.
        factor_max, factor_min, factor_threshold: clamps of the compressed-phase factor.
    """

    scale_groups = "model"

    def __init__(
        self,
        params: Iterable[Any],
        buckets: Sequence[Bucket],
        exchange: Exchange,
        *,
        num_ids: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, buckets, exchange, defaults, {"step": 0})
        first = self.param_groups[0]
        first.setdefault("lamb_coeff_freeze", [0.0] * num_ids)
        first.setdefault("last_factor", [1.0] * num_ids)
        first.setdefault("scaling_coeff", None)
        self.num_ids = num_ids
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        self._numel = torch.zeros(num_ids, dtype=torch.float64)
        for bucket in self.buckets:
            for start, end, pid in bucket.params:
                self._numel[pid] = end - start
        self._trained = sorted({pid for b in self.buckets for _, _, pid in b.params})
        self._group_of = {
            pid: group
            for bucket in self.buckets
            for start, end, group in bucket.groups
            for s, _, pid in bucket.params
            if start <= s < end
        }

    def wants_averaged_gradients(self) -> bool:
        """Averaged gradients during the warm-up (the first step, an initialisation, uses
        none). As in DeepSpeed the first step never ends the warm-up."""
        return 0 < self.steps < max(self.freeze_step, 2)

    # -- per-parameter values -----------------------------------------------------------------

    def _per_id(self, key: str) -> torch.Tensor:
        return torch.tensor(self.param_groups[0][key], dtype=torch.float64)

    def _store(self, key: str, values: torch.Tensor) -> None:
        self.param_groups[0][key] = values.tolist()

    def _sums(self, terms: Sequence[tuple[Piece, torch.Tensor]]) -> torch.Tensor:
        """Per parameter id: the sum of squares of each term over the parameter, reduced
        across the ranks sharing it (fp64)."""
        out = torch.zeros(self.num_ids, dtype=torch.float64)
        for piece, x in terms:
            for start, end, pid in piece.segments:
                out[pid] += squared_norm(x[start:end]).cpu()
        self.exchange.sum_over_shards(out)
        return out

    def _expand(self, piece: Piece, values: torch.Tensor) -> torch.Tensor:
        """``values`` (per id) spread over the piece's elements (0 where no parameter)."""
        lengths, ids = segment_runs(piece.segments, piece.param.numel())
        padded = torch.cat([values, torch.zeros(1, dtype=values.dtype)])
        per_run = padded[torch.tensor(ids, dtype=torch.long)].to(torch.float32)
        return torch.repeat_interleave(
            per_run, torch.tensor(lengths), output_size=piece.param.numel()
        ).to(piece.param.device)

    def _scale_by_param(
        self, fulls: Sequence[torch.Tensor], coeff: torch.Tensor, divide: bool = False
    ) -> None:
        """Multiply (or divide) each parameter's range of the full buckets by its
        coefficient."""
        for bucket, full in zip(self.buckets, fulls, strict=True):
            for start, end, pid in bucket.params:
                if divide:
                    full[start:end].div_(float(coeff[pid]))
                else:
                    full[start:end].mul_(float(coeff[pid]))

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: initialisation, warm-up LAMB, or the compressed phase."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.steps >= max(self.freeze_step, 2)
        step = self._count_step()
        for bucket in self.buckets:
            for piece in bucket.pieces:
                state = self.piece_state(piece)
                for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                    state.setdefault(key, torch.zeros_like(piece.param))
        if step == 1:
            return loss  # an initialisation step, as in DeepSpeed
        if compressed:
            self._compressed_step()
        else:
            self._warmup_step(step)
        return loss

    def _warmup_step(self, step: int) -> None:
        updates = []
        for bucket in self.buckets:
            for piece, group in self.groups_of(bucket):
                state, grad = self.piece_state(piece), piece.param.grad
                if grad is None:
                    grad = torch.zeros_like(piece.param)
                beta1, beta2 = group["betas"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if step == self.freeze_step:
                    state["exp_avg_sq_fresh"].copy_(v)
                updates.append((piece, adam_update(piece.param, m, v, group)))
        weights = self._sums([(p, p.param) for p, _ in updates]).sqrt()
        norms = self._sums(updates).sqrt()
        ratio = torch.ones(self.num_ids, dtype=torch.float64)
        freeze = self._per_id("lamb_coeff_freeze")
        for pid in self._trained:
            w, u = float(weights[pid]), float(norms[pid])
            if w == 0 or u == 0:
                continue
            group = self.param_groups[self._group_of[pid]]
            coeff = min(max(w / u, group["min_coeff"]), group["max_coeff"])
            ratio[pid] = coeff
            if coeff != 1.0:
                freeze[pid] = self.coeff_beta * freeze[pid] + (1 - self.coeff_beta) * coeff
        self._store("lamb_coeff_freeze", freeze)
        self._apply(updates, ratio)

    def _apply(self, updates: Sequence[tuple[Piece, torch.Tensor]], coeff: torch.Tensor) -> None:
        for piece, update in updates:
            lr = self.param_groups[piece.group]["lr"]
            piece.param.addcmul_(self._expand(piece, coeff), update, value=-lr)

    def _scaling(self, momenta: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each parameter's scaling coefficient (fixed at the first compressed step): the
        mean of the parameters' momentum magnitudes (root mean square) over its own."""
        saved = self.param_groups[0]["scaling_coeff"]
        if saved is not None:
            return torch.tensor(saved, dtype=torch.float64)
        squares = torch.zeros(self.num_ids, dtype=torch.float64)
        for bucket, m in zip(self.buckets, momenta, strict=True):
            for start, end, pid in bucket.params:
                squares[pid] += squared_norm(m[start:end]).cpu()
        scales = (squares / self._numel.clamp(min=1)).sqrt()
        trained = torch.tensor(self._trained, dtype=torch.long)
        united = scales[trained].mean()
        coeff = torch.ones(self.num_ids, dtype=torch.float64)
        nonzero = trained[scales[trained] > 0]
        coeff[nonzero] = united / scales[nonzero]
        self._store("scaling_coeff", coeff)
        return coeff

    def _compressed_step(self) -> None:
        momenta = self._momenta()
        last = {
            id(p.param): self.piece_state(p)["exp_avg"].clone()
            for b in self.buckets
            for p in b.pieces
        }
        scaling = self._scaling(momenta)
        self._fold_gradients(momenta)
        self._scale_by_param(momenta, scaling)
        self._average(momenta, "momentum")
        self._scale_by_param(momenta, scaling, divide=True)
        updates, prelims, factors = (
            [],
            [],
            torch.full((self.num_ids,), -math.inf, dtype=torch.float64),
        )
        for bucket in self.buckets:
            for piece, group in self.groups_of(bucket):
                state = self.piece_state(piece)
                beta1, beta2 = group["betas"]
                m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
                implied = (m - last[id(piece.param)] * beta1) / (1 - beta1)
                fresh.mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
                denom = v.sqrt().add_(group["eps"])
                prelim = m / denom
                update = prelim.clone()
                if group["weight_decay"] > 0:
                    update.add_(piece.param, alpha=group["weight_decay"])
                ratio = denom.div_(fresh.sqrt().add_(group["eps"]))
                for start, end, pid in piece.segments:
                    if end > start:
                        factors[pid] = max(float(factors[pid]), float(ratio[start:end].max()))
                updates.append((piece, update))
                prelims.append((piece, prelim))
        self.exchange.max_over_shards(factors)
        update_norms = self._sums(updates).sqrt()
        prelim_norms = self._sums(prelims).sqrt()
        self._apply(updates, self._trust(factors, update_norms, prelim_norms))

    def _trust(
        self, factors: torch.Tensor, update_norms: torch.Tensor, prelim_norms: torch.Tensor
    ) -> torch.Tensor:
        """Per parameter: ``lamb_coeff_freeze`` times the clamped factor (and the factor
        remembered for the next step's clamp)."""
        last = self._per_id("last_factor")
        freeze = self._per_id("lamb_coeff_freeze")
        coeff = torch.ones(self.num_ids, dtype=torch.float64)
        for pid in self._trained:
            factor = float(factors[pid])
            if self.param_groups[self._group_of[pid]]["weight_decay"] > 0:
                norm = float(update_norms[pid])
                ratio = min(1.0, float(prelim_norms[pid]) / norm) if norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            previous = float(last[pid])
            factor = min(
                max(factor, previous * (1.0 - self.factor_threshold)),
                previous * (1.0 + self.factor_threshold),
            )
            last[pid] = factor
            coeff[pid] = float(freeze[pid]) * factor
        self._store("last_factor", last)
        return coeff

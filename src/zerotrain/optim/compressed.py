"""What the 1-bit optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) share.

They differ from the other optimizers in two ways.

* **They see whole buckets, not only this rank's pieces.** The momentum they exchange is the
  average over ranks of every element, so each rank keeps the momentum of its units in full
  (a :class:`Bucket` per unit, padded for the compressed all-reduce) and reads its *own*
  gradient of the whole unit once the warm-up is over. What a rank updates is still its
  pieces (its shard at ZeRO stage 1); the variance, and the server half of the error
  feedback, exist only for them.
* **They communicate.** Through an :class:`Exchange` the engine builds over the
  data-parallel group: the compressed average, an all-gather of owned ranges (stage 1), and
  per-parameter sums and maxima across shards. The math here knows nothing of ranks.

Counters (steps, the 0/1 Adam schedules) live in the param groups, which checkpoints save
for every layout; the error-feedback buffers (and 0/1 Adam's local-step buffers) are this
rank's own: :meth:`CompressedOptimizer.rank_local_state` hands them to the checkpoint,
which gives them back only to a job of the same layout, and resets them otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

SegmentSpan = tuple[int, int, int]  # (start, end, parameter id)


@dataclass(frozen=True)
class Piece:
    """The part of one optimizer group's parameters in a bucket that this rank updates.

    ``param`` is updated in place (an fp32 master slice, or the parameters' own); ``start``
    is its offset in the bucket; ``segments`` the ``(start, end, id)`` of every parameter
    fragment inside it, relative to ``param``.
    """

    group: int
    param: torch.Tensor
    start: int
    segments: tuple[SegmentSpan, ...]

    @property
    def stop(self) -> int:
        """One past the piece's last element in the bucket."""
        return self.start + self.param.numel()


@dataclass(frozen=True)
class Bucket:
    """One unit of the model as the 1-bit optimizers see it.

    Args:
        numel: length of the unit's flat buffer (padded for the compressed all-reduce).
        owned: ``[lo, hi)`` this rank updates (the whole buffer at ZeRO stage 0).
        params: ``(start, end, id)`` of every trained parameter in the buffer.
        groups: ``(start, end, group)``: the optimizer group of each range of the buffer
            (parameters of one group are contiguous; padding belongs to none).
        pieces: what this rank updates, by optimizer group.
        gradient: this rank's gradient of the whole buffer (fp32, ``numel`` elements): its
            own (not averaged) once the optimizer asked for local gradients.
    """

    numel: int
    owned: tuple[int, int]
    params: tuple[SegmentSpan, ...]
    groups: tuple[tuple[int, int, int], ...]
    pieces: tuple[Piece, ...]
    gradient: Callable[[], torch.Tensor]


class Exchange(Protocol):
    """The collectives the 1-bit optimizers need, over the data-parallel group."""

    @property
    def world_size(self) -> int: ...

    def average(
        self,
        buckets: Sequence[torch.Tensor],
        worker_errors: Sequence[torch.Tensor],
        server_errors: Sequence[torch.Tensor],
        label: str,
    ) -> None:
        """Replace ``buckets`` by their compressed average over the ranks (error feedback
        in the two error lists, one full and one chunk per bucket)."""

    def server_error_numel(self, bucket: int) -> int:
        """Length of this rank's server error for ``bucket``."""

    def buffers(self) -> list[torch.Tensor]:
        """Scratch the exchange keeps between steps."""

    def gather_owned(self, fulls: Sequence[torch.Tensor]) -> None:
        """Every rank's owned range of each bucket into every rank's copy (stage 1)."""

    def sum_over_shards(self, tensor: torch.Tensor) -> None:
        """Sum per-parameter partial values across the ranks sharing the parameters."""

    def max_over_shards(self, tensor: torch.Tensor) -> None:
        """Maximum of per-parameter partial values across those ranks."""


class CompressedOptimizer(torch.optim.Optimizer):
    """The common frame: param groups over this rank's pieces, buckets, the exchange, and
    the error-feedback buffers (made at the first compressed step).

    Args:
        params: param groups whose ``params`` are the pieces' tensors.
        buckets: every unit, in order.
        exchange: the collectives.
        defaults: hyperparameters.
        counters: per-group counters and their initial values (checkpointed with the groups).
    """

    #: Scale groups of the compressed average: "parameter" (one scale per parameter, as
    #: DeepSpeed's 1-bit Adam and 0/1 Adam) or "model" (one for everything, 1-bit LAMB).
    scale_groups = "parameter"
    #: Read by the ZeRO step: a parameter without a gradient cannot be left out.
    steps_unused_because = "the 1-bit optimizers average the momentum of every parameter"

    def __init__(
        self,
        params: Iterable[Any],
        buckets: Sequence[Bucket],
        exchange: Exchange,
        defaults: dict[str, Any],
        counters: dict[str, Any],
    ) -> None:
        super().__init__(params, defaults)
        self.buckets = list(buckets)
        self.exchange = exchange
        for group in self.param_groups:
            for key, value in counters.items():
                group.setdefault(key, value)
        self.worker_errors: list[torch.Tensor] = []
        self.server_errors: list[torch.Tensor] = []
        self.momenta: list[torch.Tensor] = []  # each bucket's momentum, in full
        self._loaded = False  # a checkpoint was loaded since the last step

    # -- what the engine asks -------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.param_groups[0]["step"])

    def wants_averaged_gradients(self) -> bool:
        """Whether the next step needs the gradients averaged in full precision (False: each
        rank's own gradient, which the optimizer communicates itself)."""
        raise NotImplementedError

    def _count_step(self) -> int:
        """Advance every group's step counter; returns the new step number."""
        for group in self.param_groups:
            group["step"] += 1
        return self.steps

    # -- buffers ----------------------------------------------------------------------------------

    def _full(self) -> list[torch.Tensor]:
        return [
            torch.zeros(b.numel, dtype=torch.float32, device=self._device) for b in self.buckets
        ]

    @property
    def _device(self) -> torch.device:
        for bucket in self.buckets:
            for piece in bucket.pieces:
                return piece.param.device
        return self.param_groups[0]["params"][0].device

    def _ensure_errors(self) -> None:
        if not self.worker_errors:
            self.worker_errors = self._full()
            self.server_errors = [
                torch.zeros(self.exchange.server_error_numel(i), device=self._device)
                for i in range(len(self.buckets))
            ]

    def zero_errors(self) -> None:
        """Reset the error feedback (both halves) to zero."""
        for t in (*self.worker_errors, *self.server_errors):
            t.zero_()

    def _average(self, fulls: Sequence[torch.Tensor], label: str) -> None:
        """The compressed average of ``fulls`` (in place); exact (nothing to do) on 1 rank."""
        if self.exchange.world_size == 1:
            return
        self._ensure_errors()
        self.exchange.average(fulls, self.worker_errors, self.server_errors, label)

    def piece_state(self, piece: Piece) -> dict[str, Any]:
        """The optimizer state of ``piece``."""
        return self.state[piece.param]

    def groups_of(self, bucket: Bucket) -> Iterable[tuple[Piece, dict[str, Any]]]:
        """Each piece of ``bucket`` with its param group."""
        for piece in bucket.pieces:
            yield piece, self.param_groups[piece.group]

    def state_tensors(self) -> list[torch.Tensor]:
        """The buffers kept beside ``self.state`` (memory accounting)."""
        return [*self.momenta, *self.worker_errors, *self.server_errors, *self.exchange.buffers()]

    # -- rank-local state (checkpoints) ------------------------------------------------------------

    def rank_local_fingerprint(self) -> str:
        """What the rank-local state depends on: the number of ranks and the buckets."""
        sizes = ",".join(str(b.numel) for b in self.buckets)
        return f"{type(self).__name__}/ranks={self.exchange.world_size}/buckets={sizes}"

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's own buffers, by name (empty before the first compressed step)."""
        out = {}
        for i, (w, s) in enumerate(zip(self.worker_errors, self.server_errors, strict=True)):
            out[f"worker_error.{i}"] = w
            out[f"server_error.{i}"] = s
        return out

    def load_rank_local_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """After a checkpoint load: this rank's saved buffers (``rank_local_state``'s), or
        None when they do not apply (another layout): then they start from zero."""
        self.worker_errors, self.server_errors = [], []
        self._loaded = True
        if not tensors:
            return
        self._ensure_errors()
        for i, (w, s) in enumerate(zip(self.worker_errors, self.server_errors, strict=True)):
            w.copy_(tensors[f"worker_error.{i}"])
            s.copy_(tensors[f"server_error.{i}"])

    # -- the momentum every rank keeps in full ---------------------------------------------

    def _momenta(self) -> list[torch.Tensor]:
        """Each bucket's momentum in full, with every piece's ``exp_avg`` state a view of it
        (so checkpoints see it). Built from the pieces' ``exp_avg`` at the first compressed
        step and after a checkpoint load: at stage 1 each rank holds its shard of it, and
        the ranks all-gather them (the momentum is the same on every rank)."""
        if self.momenta and not self._loaded:
            return self.momenta
        momenta = self._full()
        sharded = False
        for b, bucket in enumerate(self.buckets):
            sharded |= bucket.owned != (0, bucket.numel)
            for piece in bucket.pieces:
                state = self.piece_state(piece)
                if "exp_avg" in state:
                    momenta[b][piece.start : piece.stop].copy_(state["exp_avg"].view(-1))
        if sharded:
            self.exchange.gather_owned(momenta)
        self._attach_views(momenta)
        self.momenta = momenta
        self._loaded = False
        return momenta

    def _attach_views(self, momenta: Sequence[torch.Tensor]) -> None:
        for b, bucket in enumerate(self.buckets):
            for piece in bucket.pieces:
                self.piece_state(piece)["exp_avg"] = momenta[b][piece.start : piece.stop]

    def _fold_gradients(self, momenta: Sequence[torch.Tensor]) -> None:
        """``m = beta1 * m + (1 - beta1) * g`` over whole buckets, with this rank's gradient
        (each range with its group's beta1)."""
        for bucket, m in zip(self.buckets, momenta, strict=True):
            g = bucket.gradient()
            for start, end, group in bucket.groups:
                beta1 = self.param_groups[group]["betas"][0]
                m[start:end].mul_(beta1).add_(g[start:end], alpha=1 - beta1)


def adam_update(
    param: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict[str, Any]
) -> torch.Tensor:
    """DeepSpeed's 1-bit update direction ``m / (sqrt(v) + eps) + weight_decay * w`` (no bias
    correction; weight decay added to the update, so it is scaled by the learning rate)."""
    update = m / v.sqrt().add_(group["eps"])
    if group["weight_decay"] > 0:
        update.add_(param, alpha=group["weight_decay"])
    return update

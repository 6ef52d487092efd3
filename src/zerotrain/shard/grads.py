"""Where a unit's gradients live, and how one reduction of them runs.

* ``FullGradients`` (stages 0 and 1): a full-size gradient buffer. When it has the
  parameters' dtype every ``param.grad`` is a view into it, so autograd accumulates
  micro-steps in place with no copies; under mixed precision (an fp32 buffer for bf16
  parameters) the fresh gradients of a unit are added in together (one foreach add) once
  the unit has them all, or when its reduction is launched or the backward pass ends. At
  the accumulation boundary the buffer is all-reduced (stage 0) or reduce-scattered in place
  into this rank's slice (stage 1).
* ``ShardedGradients`` (stages 2 and 3): only this rank's slice is kept. On every micro-step
  autograd leaves each fresh gradient in ``param.grad``; when the unit's reduction is
  launched (or the backward pass ends first) they are copied into a staging buffer in one
  foreach copy and freed, reduce-scattered, and added into the slice. Where the slice lives between
  reductions is its ``SlotStorage`` (``shard/storage.py``): in memory, or under NVMe
  optimizer offload in a swap file, resident only while a reduction adds into it and its
  write is in flight, with its norm taken on the way out for clipping.

Both take their scaling from ``divisors``: ``1 / pre_divide`` before the reduction and
``1 / post_divide`` after it, and reduce in the communication dtype: staging buffers have
it (stages 2-3); a full buffer of another dtype is converted for the reduction and back
(stages 0-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerotrain.config.policies import GradReducePolicy
from zerotrain.shard.flat_buffer import FlatParamBuffer
from zerotrain.shard.io import CollectiveIO, Op
from zerotrain.shard.partitioned import PartitionedParams
from zerotrain.shard.staging import StagingSource
from zerotrain.shard.storage import ResidentSlot, SlotStorage, StatePlacement
from zerotrain.utils.invariant import invariant

StagingProvider = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class StagingViews:
    """The views one unit takes of a staging buffer, made once per (buffer, unit)."""

    used: torch.Tensor  # the unit's part: its padded size
    params: list[torch.Tensor]  # each parameter's, shaped like it
    padding: torch.Tensor  # after the parameters (zeros in every reduction)
    owned: torch.Tensor  # this rank's range: the reduce-scatter's output

    @staticmethod
    def of(
        buffer: torch.Tensor,
        params: FlatParamBuffer | PartitionedParams,
        owned: tuple[int, int],
    ) -> StagingViews:
        """The views unit ``params`` (owning ``owned`` of it) takes of ``buffer``."""
        layout = params.layout
        used = buffer[: layout.padded_numel]
        return StagingViews(
            used=used,
            params=[params.view(used, i) for i in range(len(params.params))],
            padding=used[layout.numel :],
            owned=used[owned[0] : owned[1]],
        )


def divisors(
    policy: GradReducePolicy, accumulated: torch.dtype, wire: torch.dtype
) -> tuple[float, float]:
    """``(pre, post)``: what one reduction divides by before and after it (their product is
    ranks x micro-steps when gradients accumulate for several micro-steps).

    A wire narrower than the dtype the gradients accumulated in is sized for an average
    gradient, not for a sum over ranks and micro-steps: everything is divided before
    narrowing. Staged gradients (stages 2-3) are narrowed as they arrive, one micro-step at
    a time (``accumulated`` is the wire dtype), and keep the policy's split (DeepSpeed's
    ``gradient_predivide_factor``).
    """
    if wire.itemsize < accumulated.itemsize:
        return policy.pre_divide * policy.post_divide, 1.0
    return policy.pre_divide, policy.post_divide


class FullGradients:
    """A full-size gradient buffer with ``param.grad`` views (stages 0-1).

    Args:
        buffer: the unit's parameters.
        owned: ``[lo, hi)`` of the buffer this rank steps (the whole buffer at stage 0).
        sharded: reduce-scatter into ``owned`` (stage 1) instead of all-reducing (stage 0).
        dtype: of the accumulation buffer (default: the parameters').
        comm_dtype: dtype of the reduction (default: ``dtype``).
    """

    def __init__(
        self,
        buffer: FlatParamBuffer,
        owned: tuple[int, int],
        sharded: bool,
        dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        self.buffer = buffer
        self.sharded = sharded
        self.owned = owned
        self.flat = torch.zeros_like(buffer.data, dtype=dtype or buffer.dtype)
        self.comm_dtype = comm_dtype or self.flat.dtype
        # param.grad must have the parameter's dtype: views only when the buffer has it.
        self.views = self.flat.dtype == buffer.dtype
        self.shard = self.flat[owned[0] : owned[1]]
        # Each parameter's view of the buffer, made once: every backward pass attaches them
        # (a pipeline's, once per micro-batch) and every gradient hook compares with them.
        self._param_views = [buffer.view(self.flat, i) for i in range(len(buffer.params))]
        # Stage 1 keeps whole gradients, which stay in memory even under NVMe offload.
        self.slot: SlotStorage = ResidentSlot(self.shard)
        # Parameters whose param.grad holds a fresh gradient not yet added in, in order.
        self._pending: dict[int, None] = {}
        # Gradients from before the engine existed are not part of any window.
        for param in buffer.params:
            param.grad = None

    def place(self, placement: StatePlacement) -> None:
        """Nothing to place: whole gradients stay in memory."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradient values now (the buffer, and ``param.grad`` tensors
        of their own when the buffer's dtype differs), for ``engine.offload_states``."""
        return [self.flat, *(p.grad for p in self.buffer.params if p.grad is not None)]

    @property
    def nbytes(self) -> int:
        """Bytes of gradient storage."""
        return self.flat.numel() * self.flat.element_size()

    def bind(self) -> None:
        """Point every ``param.grad`` at its view of the buffer (when dtypes allow)."""
        for param, view in zip(self.buffer.params, self._param_views, strict=True):
            param.grad = view if self.views else None

    def holds(self, index: int, grad: torch.Tensor | None) -> bool:
        """``grad`` is ``params[index]``'s view of the buffer (autograd adds into it)."""
        view = self._param_views[index]
        return self.views and grad is not None and grad.data_ptr() == view.data_ptr()

    def attach(self) -> None:
        """Before the engine's own backward: fold gradients left in ``param.grad`` by
        backward passes outside it (and not cleared since) into the buffer, as plain PyTorch
        would accumulate them, then let autograd accumulate into the buffer's views."""
        if not self.views:
            return  # autograd adds to what param.grad holds; accept() folds the sum in
        for param, view in zip(self.buffer.params, self._param_views, strict=True):
            outside = param.grad
            if outside is not None and outside.data_ptr() != view.data_ptr():
                view.add_(outside)
            param.grad = view

    def detach(self) -> None:
        """After the engine's own backward: ``param.grad`` no longer shows the buffer, so
        gradients of other backward passes (a GAN's generator loss reaching the
        discriminator) land in ``param.grad`` where ``zero_grad()`` can clear them, instead
        of mixing into this window's gradients."""
        self.complete()
        if self.views:
            for param in self.buffer.params:
                param.grad = None

    def accept(self, index: int, staging: StagingProvider) -> None:
        """Autograd produced ``params[index]``'s gradient. It is normally already in the
        buffer; under mixed precision, or if something replaced ``param.grad``
        (``model.zero_grad()`` sets it to None, after which autograd allocates a fresh
        tensor), fold that tensor in."""
        param = self.buffer.params[index]
        view = self._param_views[index]
        current = param.grad
        if current is not None and current.data_ptr() == view.data_ptr():
            return
        if current is None:
            param.grad = view if self.views else None
        else:
            self._pending[index] = None  # added in by complete(), with the unit's others

    def complete(self) -> None:
        """Add the fresh gradients accepted so far into the buffer, one foreach add, and
        free them (every gradient of the unit arrived, its reduction is launched, or the
        backward pass is over)."""
        if not self._pending:
            return
        params = self.buffer.params
        fresh = {i: g for i in self._pending if (g := params[i].grad) is not None}
        with torch.no_grad():
            torch._foreach_add_([self._param_views[i] for i in fresh], list(fresh.values()))
        for i in self._pending:
            params[i].grad = self._param_views[i] if self.views else None
        self._pending.clear()

    def reduce(
        self,
        policy: GradReducePolicy,
        on_done: Callable[[], None],
        label: str | None = None,
    ) -> CollectiveIO:
        """The reduction that averages the buffer across ranks (pre-divided already);
        ``shard`` holds the result when it is done."""
        self.complete()
        pre, post = divisors(policy, self.flat.dtype, self.comm_dtype)
        if pre != 1.0:
            self.flat.div_(pre)
        wire = self.flat if self.comm_dtype == self.flat.dtype else self.flat.to(self.comm_dtype)
        lo, hi = self.owned
        result = wire[lo:hi] if self.sharded else wire

        def finish() -> None:
            # Divided in the wider dtype before any narrowing copy: one rounding.
            if post != 1.0:
                result.div_(post)
            if result.data_ptr() != self.shard.data_ptr():
                self.shard.copy_(result)
            on_done()

        # Reduce-scatter in place: this rank's slice of the input is the output.
        op: Op = "reduce_scatter" if self.sharded else "all_reduce"
        return CollectiveIO(op, result, wire, "gradients", label, finish)

    def zero(self) -> None:
        """Start a new accumulation window."""
        self.flat.zero_()

    def reset(self) -> None:
        """Drop whatever a failed backward pass left behind."""
        for i in self._pending:
            self.buffer.params[i].grad = None
        self._pending.clear()
        self.zero()

    def zero_values(self) -> None:
        """Zero the gradient in place (``engine.zero_grad()``)."""
        self.zero()


class ShardedGradients:
    """Only this rank's slice of the gradient is kept (stages 2-3).

    Args:
        buffer: the unit's parameters.
        owned: ``[lo, hi)`` of the buffer this rank steps.
        pool: where staging buffers come from (sized for the largest unit; their dtype is
            the one gradients are reduced in).
        dtype: of the accumulated slice (default: the parameters').
    """

    def __init__(
        self,
        buffer: FlatParamBuffer | PartitionedParams,
        owned: tuple[int, int],
        pool: StagingSource,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.buffer = buffer
        self.owned = owned
        self.pool = pool
        self.shard = torch.zeros(
            owned[1] - owned[0], dtype=dtype or buffer.dtype, device=buffer.device
        )
        # (pool buffer, this unit's views of it) while gradients are being staged
        self._staging: tuple[torch.Tensor, StagingViews] | None = None
        self._staged: set[int] = set()  # parameters copied into staging this micro-step
        # Parameters whose param.grad holds a gradient not yet in staging, in arrival order.
        self._pending: dict[int, None] = {}
        self._shard_is_zero = True  # the next reduction can overwrite instead of adding
        self._window_reduced = False  # the window's last reduction is in the slice
        self.slot: SlotStorage = ResidentSlot(self.shard)

    def place(self, placement: StatePlacement) -> None:
        """Give the slice the storage ``placement`` decides (once, as the unit is built)."""
        self.slot = placement.grad_slice(self.shard)
        invariant(self.slot.tensor is self.shard, "the slot must hold this slice")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradient values now (the slice, a staging buffer held in
        the middle of a window, fresh ``param.grad``), for ``engine.offload_states``."""
        staging = [] if self._staging is None else [self._staging[0]]
        grads = [p.grad for p in self.buffer.params if p.grad is not None]
        return [self.shard, *staging, *grads]

    @property
    def nbytes(self) -> int:
        """Bytes of the owned slice in memory (staging buffers are counted by the pool)."""
        return self.slot.resident_bytes

    def attach(self) -> None:
        """Nothing to prepare: autograd adds to whatever ``param.grad`` holds (gradients of
        backward passes outside the engine, not cleared since) and ``accept`` takes it."""

    def detach(self) -> None:
        """After the engine's backward pass: move the gradients of a unit whose reduction
        was not launched (a pass that does not synchronise) into staging, so ``param.grad``
        is empty between passes, as before any gradient arrived."""
        self._flush()

    @property
    def staged(self) -> bool:
        """Whether a staging buffer is held (gradients staged, not yet reduced)."""
        return self._staging is not None

    def _stage(self, staging: StagingProvider) -> tuple[torch.Tensor, StagingViews]:
        """The staging buffer this unit holds (taken from the pool on first need), and its
        views of it (made on the first use of that buffer by this unit, then kept)."""
        if self._staging is None:
            pooled = staging()
            views = self.pool.views(
                pooled, self, lambda b: StagingViews.of(b, self.buffer, self.owned)
            )
            self._staging = (pooled, views)
        return self._staging

    def _views(self) -> StagingViews:
        invariant(self._staging is not None, "staging views without a staging buffer")
        return self._staging[1]  # type: ignore[index]

    def accept(self, index: int, staging: StagingProvider) -> None:
        """``params[index]``'s gradient is in ``param.grad``: it stays there (autograd adds
        any later contribution of this micro-step to it) until the unit's gradients move
        into staging together. The staging buffer is taken now, as the first gradient
        arrives, so that the pool is drawn on in the order units fill."""
        if self.buffer.params[index].grad is None:
            return
        self._stage(staging)
        self._pending[index] = None

    def complete(self) -> None:
        """Every gradient of the unit arrived: move them into staging now."""
        self._flush()

    def _flush(self) -> None:
        """Copy (or add, for a parameter staged earlier in the window) every pending
        gradient into staging, one foreach operation each way, and free them."""
        if not self._pending:
            return
        views = self._views().params
        params = self.buffer.params
        fresh = {i: g for i in self._pending if (g := params[i].grad) is not None}
        copy = [i for i in fresh if i not in self._staged]
        add = [i for i in fresh if i in self._staged]
        with torch.no_grad():
            if copy:  # staging is not cleared in advance: copy, don't add
                torch._foreach_copy_([views[i] for i in copy], [fresh[i] for i in copy])
            if add:
                torch._foreach_add_([views[i] for i in add], [fresh[i] for i in add])
        for i in self._pending:
            params[i].grad = None
        self._staged.update(copy)
        self._pending.clear()

    def _zero_unstaged(self, views: StagingViews) -> None:
        """Zero the parts of staging no gradient was copied into (unused parameters and
        padding contribute zeros to the reduction)."""
        unstaged = [i for i in range(len(self.buffer.params)) if i not in self._staged]
        if unstaged:
            torch._foreach_zero_([views.params[i] for i in unstaged])
        if views.padding.numel():
            views.padding.zero_()
        self._staged.clear()

    def reduce(
        self,
        policy: GradReducePolicy,
        on_done: Callable[[], None],
        staging: StagingProvider,
        label: str | None = None,
        final: bool = True,
    ) -> CollectiveIO:
        """The reduce-scatter of this micro-step's staged gradients, which adds them to
        ``shard`` when done; ``final``: the window's last reduction."""
        pooled, views = self._stage(staging)
        self._flush()
        self._zero_unstaged(views)
        self._staging = None
        full, out = views.used, views.owned
        pre, post = divisors(policy, full.dtype, full.dtype)
        if pre != 1.0:
            full.div_(pre)
        overwrite, self._shard_is_zero = self._shard_is_zero, False

        def finish() -> None:
            self.slot.materialize(read=not overwrite)
            if overwrite and post != 1.0:
                torch.div(out, post, out=self.shard)  # one op for divide-and-copy
            elif overwrite:
                self.shard.copy_(out)
            else:
                if post != 1.0:
                    out.div_(post)
                self.shard.add_(out)
            self.pool.release(pooled)
            self._window_reduced = final
            self.slot.stow(final)
            on_done()

        return CollectiveIO("reduce_scatter", out, full, "gradients", label, finish)

    def zero(self) -> None:
        """Start a new accumulation window."""
        invariant(self._staging is None, "gradients staged but never reduced")
        self._shard_is_zero = True  # the first reduction of the window overwrites it
        self._window_reduced = False

    def reset(self) -> None:
        """Drop whatever a failed backward pass left behind."""
        if self._staging is not None:
            self.pool.release(self._staging[0])
            self._staging = None
        self._staged.clear()
        self._pending.clear()
        for param in self.buffer.params:
            param.grad = None
        self.zero_values()

    def zero_values(self) -> None:
        """Zero the gradient in place (``engine.zero_grad()``)."""
        self._shard_is_zero = True
        # Nothing reads the slice before the window's last reduction, and the next
        # reduction overwrites it: a slice in a swap file skips writing a gradient's worth
        # of zeros per call then.
        self.slot.zero_(unread=not self._window_reduced)

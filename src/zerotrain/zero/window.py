"""How the next backward passes treat their gradients: the knobs a caller running several
backward passes per optimizer step sets between them, and the decision each pass takes.

* ``set_requires_gradient_sync(False)``: accumulate this rank's gradients locally and reduce
  them all at the next pass with sync (DDP's ``no_sync``; the knob torch's pipelining sets
  on FSDP2).
* ``set_gradient_averaging(wanted)``: asked as each window starts whether gradients are
  averaged across ranks at all (the 1-bit optimizers, which communicate compressed
  themselves after their warm-up); a window without it keeps each rank's own gradient.
* ``set_is_last_backward(b)``: whether the next passes close the accumulation window,
  overriding the engine's count of micro-steps (a pipeline schedule knows its last
  micro-batch); None hands the decision back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zerotrain.utils.invariant import invariant


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """What one backward pass does with its gradients."""

    last_micro_step: bool = False  # the pass is the window's last micro-step
    closes: bool = False  # ... and synchronises: the window ends with it (a step may follow)
    reduces: bool = True  # gradients are reduced across ranks in this pass
    local: bool = False  # the window keeps each rank's own gradient (no averaging)


class BackwardWindow:
    """The knobs, as set now, and the plan of the pass that begins next.

    Args:
        whole_gradients: every rank keeps whole gradients (ZeRO stages 0-1), which a
            window without averaging needs.
    """

    def __init__(self, whole_gradients: bool) -> None:
        self.whole_gradients = whole_gradients
        self.requires_sync = True
        self.averaging: Callable[[], bool] | None = None
        self.is_last_backward: bool | None = None

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """Whether the next backward passes reduce gradients across ranks. False: each pass
        accumulates this rank's gradients locally (stages 2-3 keep a full-size staged
        gradient per unit for that), and the next pass with sync reduces all of them at
        once: one reduction per window instead of one per pass."""
        self.requires_sync = requires_sync

    def set_gradient_averaging(self, wanted: Callable[[], bool] | None) -> None:
        """Who decides, window by window, whether backward passes average gradients across
        ranks: None (always; the default) or a callable asked as each pass starts. A
        window without averaging ends with each rank's own gradient, as if the ranks were
        one (divided by the micro-steps, not by the ranks)."""
        invariant(
            wanted is None or self.whole_gradients,
            "local gradients need whole gradients (ZeRO stages 0-1)",
        )
        self.averaging = wanted

    def set_is_last_backward(self, is_last: bool | None) -> None:
        """Whether the next backward passes close the accumulation window, overriding what
        the caller of ``plan`` says; None hands the decision back to it."""
        self.is_last_backward = is_last

    def plan(self, boundary: bool) -> PassPlan:
        """The plan of a pass that the engine's count calls the window's last or not."""
        if self.is_last_backward is not None:
            boundary = self.is_last_backward
        local = self.averaging is not None and not self.averaging()
        return PassPlan(
            last_micro_step=boundary,
            closes=boundary and self.requires_sync,
            reduces=self.requires_sync and not local,
            local=local,
        )

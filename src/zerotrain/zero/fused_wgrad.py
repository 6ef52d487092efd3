"""Weight gradients of ``nn.Linear`` added straight into ``param.grad`` (Megatron's
``gradient_accumulation_fusion``, for plain PyTorch layers).

Autograd computes a linear layer's weight gradient into a fresh tensor, then adds that into
``param.grad``: per micro-batch, one weight-sized allocation and one extra read-modify-write
pass over the gradient. On an accumulation micro-step the engine only keeps the gradient (it
reduces nothing), and ``param.grad`` is already a view of the unit's gradient buffer, so the
layer can accumulate in place with one ``addmm_``. On a CPU, where a fresh weight-sized
tensor also costs page faults, the product alone ran ~4x slower than the in-place one.

Only where the result is the same as autograd's is the short cut taken, decided per layer
call in backward (``takes`` below); everywhere else the layer runs PyTorch's own
``F.linear``. The weight's post-accumulate-grad hooks still run where autograd runs them.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Takes = Callable[[torch.Tensor], bool]

# Smaller weights keep autograd's path. The custom backward costs ~0.1 ms of Python per call
# on this CPU, and small weights gain nothing: a fresh 256 KiB gradient comes from the
# allocator's cache, and on the demo GPT (width 128: 136 linear calls per step) the fused
# stage was 1.03-1.10x slower. From 2^20 elements (4 MiB in fp32) on, the in-place add won
# 15-20% of the whole step of an MLP of width 512 (benchmarks/pipeline.py).
SMALLEST_FUSED_WEIGHT = 1 << 20


def _pre_hook_count(param: torch.Tensor) -> int:
    hooks = getattr(param, "_backward_hooks", None)
    return len(hooks) if hooks else 0


class _LinearAccumulatingWeightGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient into ``weight.grad`` in place
    when ``takes(weight)`` allows it at that moment (else returns it, as autograd would)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, takes: Takes
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.takes = takes
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = rows_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows_in = x.reshape(-1, x.shape[-1])
            if not torch.is_grad_enabled() and ctx.takes(weight):
                # Returning None leaves autograd's accumulation of this weight nothing to
                # add, and it still runs the weight's post-accumulate-grad hooks (the
                # engine's readiness signal) once every contribution is in.
                weight.grad.addmm_(rows_out.t(), rows_in)
            else:
                grad_weight = rows_out.t() @ rows_in
        return grad_x, grad_weight, grad_bias, None


class _Forward:
    """A fused layer's ``forward`` (an instance attribute shadowing ``nn.Linear.forward``).
    It reaches the fusion weakly: the engine owns it, not the model. A pickled or copied
    layer gets the plain ``nn.Linear.forward`` instead (no engine manages the copy)."""

    __slots__ = ("fusion", "layer")

    def __init__(self, fusion: weakref.ref[WeightGradFusion], layer: nn.Linear) -> None:
        self.fusion = fusion
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> Any:
        layer = self.layer
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return F.linear(x, layer.weight, layer.bias)
        owner = self.fusion()
        if (
            owner is None
            or not layer.weight.requires_grad
            or torch.is_autocast_enabled(x.device.type)  # autocast casts inside F.linear
        ):
            return F.linear(x, layer.weight, layer.bias)
        return _LinearAccumulatingWeightGrad.apply(x, layer.weight, layer.bias, owner.takes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (nn.Linear.forward, self.layer))


class WeightGradFusion:
    """Installs the accumulating linear on every plain ``nn.Linear`` of ``model`` whose
    weight is trainable, large enough to gain, and not shared with another module (a
    shared weight keeps autograd's path: its contributions meet in autograd's one
    accumulation, as without the fusion).

    Args:
        model: the engine's module.
        takes: whether ``param.grad`` of this parameter may be added to in place right now
            (the engine's own backward pass, reducing nothing, with ``param.grad`` the view
            of the unit's buffer that autograd would add into).
        smallest: layers with fewer weight elements keep autograd's path.
    """

    def __init__(
        self, model: nn.Module, takes: Takes, smallest: int = SMALLEST_FUSED_WEIGHT
    ) -> None:
        self._takes = takes
        # One pre-hook per parameter is the engine's own (it ignores the gradient's value
        # inside the engine's backward); a parameter with more gets autograd's path.
        self._own_pre_hooks = 1
        uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self.layers: list[nn.Linear] = [
            m
            for m in model.modules()
            if type(m) is nn.Linear
            and "forward" not in vars(m)
            and m.weight.requires_grad
            and m.weight.numel() >= smallest
            and uses[id(m.weight)] == 1
        ]
        me = weakref.ref(self)
        for layer in self.layers:
            # The layer holds its _Forward, which holds the layer: a cycle the collector
            # frees with the model.
            layer.forward = _Forward(me, layer)  # type: ignore[method-assign,assignment]

    def takes(self, weight: torch.Tensor) -> bool:
        return _pre_hook_count(weight) <= self._own_pre_hooks and self._takes(weight)

    def remove(self) -> None:
        """Give every layer back its own ``forward``."""
        for layer in self.layers:
            if isinstance(vars(layer).get("forward"), _Forward):
                del layer.forward
        self.layers = []

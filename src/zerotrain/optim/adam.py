"""Adam / AdamW on flat 1-D tensors.

With bias correction (the default) the update runs in torch's fused kernel (one pass over
memory for the whole flat buffer); ``bias_correction=False``, which torch's kernels cannot
express, runs a chunked version of the same arithmetic. Follows DeepSpeed's semantics:
``adam_w_mode=True`` (the default, also for type "Adam") decouples weight decay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from zerotrain.optim.base import FlatOptimizer

_CHUNK = 1 << 20  # elements per chunk in the unfused path: keeps temporaries cache-sized


def adam_defaults(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    adam_w_mode: bool,
    amsgrad: bool,
) -> dict[str, Any]:
    """Adam's param-group defaults (shared with the offloaded step, whose groups and
    checkpoints must carry the same options)."""
    return {
        "lr": lr,
        "betas": tuple(betas),
        "eps": eps,
        "weight_decay": weight_decay,
        "bias_correction": bias_correction,
        "adam_w_mode": adam_w_mode,
        "amsgrad": amsgrad,
    }


class Adam(FlatOptimizer):
    """Adam over flat tensors.

    Args:
        params: flat tensors (or param-group dicts) whose ``.grad`` holds the gradient.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled (``adam_w_mode``) or L2 weight decay.
        bias_correction: divide the moments by ``1 - beta**t``.
        adam_w_mode: decouple weight decay from the gradient (AdamW).
        amsgrad: use the running maximum of the second moment.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        amsgrad: bool = False,
    ) -> None:
        defaults = adam_defaults(
            lr, betas, eps, weight_decay, bias_correction, adam_w_mode, amsgrad
        )
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": torch.zeros((), dtype=torch.float32, device=param.device),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param)
        return state

    def skips_on_device(self) -> bool:
        """Every group runs torch's fused kernel, which skips on ``found_inf`` by itself."""
        return all(
            group["bias_correction"] and _fused_ok(group["params"]) for group in self.param_groups
        )

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            kernel = torch_adamw if group["adam_w_mode"] else torch_adam
            kernel(
                params,
                [p.grad for p in params],  # type: ignore[misc]
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
                [s["step"] for s in states],
                fused=_fused_ok(params),
                foreach=None if _fused_ok(params) else True,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                found_inf=self.found_inf,
            )
            return
        for param, state in zip(params, states, strict=True):
            state["step"] += 1
            _adam_no_bias_correction(param, param.grad, state, group)  # type: ignore[arg-type]


def _fused_ok(params: list[torch.Tensor]) -> bool:
    # torch's fused Adam runs on CPU and CUDA for floating dtypes.
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def _adam_no_bias_correction(
    param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
) -> None:
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    n = param.numel()
    flat_p, flat_g = param.view(-1), grad.view(-1)
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    vmax = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        p, g = flat_p[lo:hi], flat_g[lo:hi]
        if wd != 0 and not group["adam_w_mode"]:
            g = g.add(p, alpha=wd)
        m[lo:hi].lerp_(g, 1 - beta1)
        v[lo:hi].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        second = v[lo:hi]
        if vmax is not None:
            torch.maximum(vmax[lo:hi], second, out=vmax[lo:hi])
            second = vmax[lo:hi]
        if wd != 0 and group["adam_w_mode"]:
            p.mul_(1 - lr * wd)
        p.addcdiv_(m[lo:hi], second.sqrt().add_(eps), value=-lr)

"""DeepSpeed's optimizer classes (``deepspeed.ops.adam.DeepSpeedCPUAdam`` / ``FusedAdam``,
``deepspeed.ops.lamb.FusedLamb``) as names for zerotrain's Adam and LAMB.

DeepSpeed's classes choose a kernel (AVX on the host, a fused CUDA kernel); the arithmetic
is Adam(W) and LAMB, which zerotrain's flat optimizers compute. Each class here takes
DeepSpeed's constructor arguments and is a working optimizer over whole parameters (so it
can be stepped by hand, or at stage 0). Given to ``zerotrain.initialize``, it stands for
the config's ``optimizer`` section with the same values (``spec_of``): the engine builds
that optimizer over its flat shards, with or without offload, exactly as from the config.
Arguments whose meaning zerotrain cannot give raise instead of being ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerotrain.config.policies import OptimizerSpec
from zerotrain.optim.adam import Adam
from zerotrain.optim.base import GROUP_LAYOUT_KEYS
from zerotrain.optim.lamb import Lamb

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "amsgrad")
_LAMB_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "max_coeff",
    "min_coeff",
    "eps_inside_sqrt",
)


def _no_amsgrad(cls: str, amsgrad: bool) -> None:
    if amsgrad:
        # DeepSpeed's FusedAdam/FusedLamb raise here; its CPU Adam accepts the flag and
        # ignores it. Running AMSGrad where DeepSpeed would not is a different optimizer.
        raise ValueError(
            f"{cls}(amsgrad=True): DeepSpeed's {cls} has no AMSGrad variant; for AMSGrad use "
            'the config\'s optimizer {"type": "Adam", "params": {"amsgrad": true}} or '
            "zerotrain.optim.Adam(amsgrad=True)"
        )


class DeepSpeedCPUAdam(Adam):
    """DeepSpeed's host Adam(W), computed by zerotrain's Adam.

    Args:
        model_params: parameters or param-group dicts.
        lr, betas, eps, weight_decay, bias_correction: as Adam.
        amsgrad: must be False (DeepSpeed's kernel has no AMSGrad).
        adamw_mode: decouple weight decay (AdamW, the default) or add it to the gradient.
        fp32_optimizer_states: must be True: zerotrain keeps moments in fp32.

    Raises:
        ValueError: ``amsgrad=True`` or ``fp32_optimizer_states=False``.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _no_amsgrad("DeepSpeedCPUAdam", amsgrad)
        if not fp32_optimizer_states:
            raise ValueError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False): zerotrain keeps Adam's moments "
                "in fp32 (beside the fp32 master weights); remove the argument"
            )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adamw_mode,
        )


class FusedAdam(Adam):
    """DeepSpeed's fused Adam(W), computed by zerotrain's Adam.

    Args:
        params: parameters or param-group dicts.
        lr, bias_correction, betas, eps, adam_w_mode, weight_decay: as Adam.
        amsgrad: must be False (DeepSpeed's FusedAdam refuses it too).
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).

    Raises:
        ValueError: ``amsgrad=True``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _no_amsgrad("FusedAdam", amsgrad)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to None unless ``set_grad_none`` was False (DeepSpeed's rule)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


def _whole_parameter_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param groups for LAMB over whole parameters: each tensor is one parameter (one
    segment, its own id), so trust ratios are per parameter as in DeepSpeed."""
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        segments = [((0, t.numel(), i),) for i, t in enumerate(tensors)]
        out.append({**group, "params": tensors, "segments": segments, "num_ids": len(tensors)})
    return out


class FusedLamb(Lamb):
    """DeepSpeed's fused LAMB, computed by zerotrain's LAMB (the same formula).

    Args:
        params: parameters or param-group dicts.
        lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_coeff,
            min_coeff: as Lamb.
        max_grad_norm: must be 0: DeepSpeed applies it only to norms its fp16 optimizer
            passes to ``step``; use the config's ``gradient_clipping``.
        amsgrad: must be False (DeepSpeed's FusedLamb refuses it too).

    Raises:
        ValueError: ``amsgrad=True`` or ``max_grad_norm > 0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        _no_amsgrad("FusedLamb", amsgrad)
        if max_grad_norm > 0:
            raise ValueError(
                f"FusedLamb(max_grad_norm={max_grad_norm}): clip with the config's "
                '"gradient_clipping" instead (DeepSpeed applies max_grad_norm only to '
                "norms its fp16 optimizer hands to step())"
            )
        super().__init__(
            _whole_parameter_groups(params),
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )


def spec_of(optimizer: Any) -> OptimizerSpec | None:
    """The config ``optimizer`` section ``optimizer`` stands for, when it is one of
    DeepSpeed's classes above (None for anything else). Group overrides stay in the
    optimizer's param groups (minus ``layout_free_options``' keys)."""
    if isinstance(optimizer, (DeepSpeedCPUAdam, FusedAdam)):
        return OptimizerSpec("adam", {k: optimizer.defaults[k] for k in _ADAM_KEYS})
    if isinstance(optimizer, FusedLamb):
        return OptimizerSpec("lamb", {k: optimizer.defaults[k] for k in _LAMB_KEYS})
    return None


def layout_free_options(options: dict[str, Any]) -> dict[str, Any]:
    """A param group's options without the entries that describe its own tensors (LAMB's
    segments over whole parameters mean nothing over the engine's flat shards)."""
    return {k: v for k, v in options.items() if k not in GROUP_LAYOUT_KEYS}

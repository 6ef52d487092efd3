"""Adam / AdamW on flat fp32 CPU tensors, one chunk at a time: the kernel of the offloaded
optimizer step.

Offloaded states arrive a chunk at a time (read from NVMe, or copied from a device), so the
update is a function of one chunk, not an optimizer object. It calls torch's fused CPU
kernel (``torch._fused_adamw_`` / ``torch._fused_adam_``), the one ``zerotrain.optim.adam.Adam``
reaches through ``torch.optim.adamw``, directly: the functional wrapper regroups tensors by
device and dtype and increments step tensors on every call, which cost more than the update
of a small chunk.

Bitwise equality with a whole-tensor step: the kernel updates each element on its own, but
it runs the elements of a call in SIMD vectors and the last ``numel % vector width`` of them
in separately compiled scalar code, which can round differently (seen with torch 2.13 on
AVX-512: ``exp_avg_sq`` differed in its last bit). A chunked step therefore
equals a whole-tensor step exactly when every chunk but the last starts and ends at a
multiple of ``CHUNK_ALIGN`` elements of the whole tensor; callers that split a shard must
keep to that, and the splits made here do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerotrain.utils.torch_compat import fused_adam_kernel

# A multiple of every SIMD width torch's CPU kernels use for fp32 (8 with AVX2, 16 with
# AVX-512), so that no element of a chunk falls into the kernel's scalar tail.
CHUNK_ALIGN = 16

# Elements per kernel call and thread when a 16-bit copy is written: the copy then reads
# parameters that the update has just left in cache (2 MiB of fp32 per thread). Measured on
# 2 cores (1 and 2 threads): 2^19 per thread beat 2^18 and 2^20 by a few percent; smaller
# chunks lose to per-call overhead, larger ones lose the cache.
LOWP_CHUNK_PER_THREAD = 1 << 19


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """The hyperparameters of one optimizer group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool = True


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hyper: AdamHyper,
    *,
    lowp_out: torch.Tensor | None = None,
    lowp_chunk: int | None = None,
) -> None:
    """Apply Adam step number ``step`` (1-based, bias-corrected) to ``param`` in place.

    Bitwise equal to ``zerotrain.optim.adam.Adam`` over the whole tensor, provided this chunk
    starts at a multiple of ``CHUNK_ALIGN`` elements of it and ends at one or at its end (see
    the module docstring).

    Args:
        param, grad, exp_avg, exp_avg_sq: flat contiguous CPU tensors of one size and one
            floating dtype (fp32 master states). ``param``, ``exp_avg`` and ``exp_avg_sq``
            are updated in place; ``grad`` is only read.
        step: the step count after this update (as in ``state["step"]``), at least 1.
        hyper: learning rate and the rest.
        lowp_out: optionally, a floating CPU tensor of the same size (bf16 or fp16: the
            compute-dtype copy of a master slice) that receives the updated parameters
            rounded to its dtype.
        lowp_chunk: elements per kernel call when ``lowp_out`` is given, a multiple of
            ``CHUNK_ALIGN``; by default ``LOWP_CHUNK_PER_THREAD`` times torch's thread count.

    Raises:
        ValueError: sizes differ, a tensor is not flat and contiguous, ``step < 1``, or
            ``lowp_chunk`` is not a positive multiple of ``CHUNK_ALIGN``.
        TypeError: dtypes or devices are not as above.
    """
    _check_operands(param, grad, exp_avg, exp_avg_sq, step, lowp_out)
    kernel = fused_adam_kernel(hyper.adam_w_mode)
    # The kernel reads the step count and leaves it alone (torch's wrapper increments it
    # before the call), so it gets the count after this update, as Adam's state holds it.
    steps = [torch.tensor(float(step), dtype=torch.float32)]
    if lowp_out is None:
        # One call: the update streams through memory once and pays the call overhead once.
        _call(kernel, param, grad, exp_avg, exp_avg_sq, steps, hyper)
        return
    chunk = _resolve_lowp_chunk(lowp_chunk)
    operands = (param, grad, exp_avg, exp_avg_sq, lowp_out)
    for p, g, m, v, out in zip(*(t.split(chunk) for t in operands), strict=True):
        _call(kernel, p, g, m, v, steps, hyper)
        out.copy_(p)  # rounds to nearest even, as ``param.to(lowp_out.dtype)``


def _resolve_lowp_chunk(lowp_chunk: int | None) -> int:
    """The elements per kernel call of a step that writes a 16-bit copy."""
    if lowp_chunk is None:
        return LOWP_CHUNK_PER_THREAD * torch.get_num_threads()
    if lowp_chunk <= 0 or lowp_chunk % CHUNK_ALIGN:
        raise ValueError(
            f"adam_step_: lowp_chunk must be a positive multiple of {CHUNK_ALIGN}, got {lowp_chunk}"
        )
    return lowp_chunk


def _call(
    kernel: Callable[..., None],
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: list[torch.Tensor],
    hyper: AdamHyper,
) -> None:
    """One call of torch's fused Adam kernel on one set of operands."""
    kernel(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        steps,
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def _check_operands(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lowp_out: torch.Tensor | None,
) -> None:
    """Raise unless the operands are what the kernel reads through raw pointers."""
    if step < 1:
        raise ValueError(f"adam_step_: step must be at least 1 (1-based), got {step}")
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if lowp_out is not None:
        named["lowp_out"] = lowp_out
        if not lowp_out.is_floating_point():
            raise TypeError(f"adam_step_: lowp_out must be floating point, got {lowp_out.dtype}")
    for name, t in named.items():
        if t.numel() != param.numel():
            raise ValueError(
                f"adam_step_: {name} has {t.numel()} elements, param has {param.numel()}"
            )
        # The kernel walks data pointers, so a strided view would be read wrongly.
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"adam_step_: {name} must be flat and contiguous, got {t.shape}")
        if t.device.type != "cpu":
            raise TypeError(f"adam_step_: {name} must be on the CPU, got {t.device}")
        if name != "lowp_out" and t.dtype != param.dtype:
            raise TypeError(f"adam_step_: {name} is {t.dtype}, param is {param.dtype}")
    if not param.is_floating_point():
        raise TypeError(f"adam_step_: param must be floating point, got {param.dtype}")

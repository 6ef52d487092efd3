"""The chunked offload kernel against zerotrain's whole-tensor Adam: bitwise, not approximately.

Loss-parity tests of offloaded training rely on ``adam_step_`` over chunks giving exactly
the parameters and moments of ``Adam`` over the whole flat shard.
"""

from __future__ import annotations

import pytest
import torch

from zerotrain.optim.adam import Adam
from zerotrain.optim.cpu_adam import (
    CHUNK_ALIGN,
    LOWP_CHUNK_PER_THREAD,
    AdamHyper,
    adam_step_,
)

STEPS = 3
# Elements per kernel call with a 16-bit copy: small, so that the sizes below split into
# several calls (with a ragged last one) and the test stays fast.
LOWP_CHUNK = 64 * CHUNK_ALIGN
# Sizes that are not multiples of the SIMD width or of the internal chunk.
SIZES = [1, 15, 1000 + 3, 5 * LOWP_CHUNK + 3 * CHUNK_ALIGN + 7]


def _grads(numel: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=gen) for _ in range(steps)]


def _reference(
    start: torch.Tensor, grads: list[torch.Tensor], hyper: AdamHyper
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    param = start.clone()
    opt = Adam(
        [param],
        lr=hyper.lr,
        betas=(hyper.beta1, hyper.beta2),
        eps=hyper.eps,
        weight_decay=hyper.weight_decay,
        adam_w_mode=hyper.adam_w_mode,
    )
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    state = opt.state[param]
    return param, state["exp_avg"], state["exp_avg_sq"]


def _chunks(numel: int, parts: int) -> list[slice]:
    """About ``parts`` caller-side chunks, each starting on the SIMD grid as callers must."""
    per_part = -(-numel // parts)
    chunk = max(CHUNK_ALIGN, -(-per_part // CHUNK_ALIGN) * CHUNK_ALIGN)
    return [slice(lo, min(numel, lo + chunk)) for lo in range(0, numel, chunk)]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("lowp", [False, True])
def test_bitwise_equal_to_whole_tensor_adam(
    numel: int, adam_w_mode: bool, weight_decay: float, parts: int, lowp: bool
) -> None:
    hyper = AdamHyper(
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
    )  # fmt: skip
    start = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    grads = _grads(numel, STEPS)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=torch.bfloat16) if lowp else None
    for step, grad in enumerate(grads, start=1):
        for s in _chunks(numel, parts):
            low = None if out is None else out[s]
            adam_step_(
                param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, hyper,
                lowp_out=low, lowp_chunk=LOWP_CHUNK,
            )  # fmt: skip
    ref_param, ref_exp_avg, ref_exp_avg_sq = _reference(start, grads, hyper)
    assert torch.equal(param, ref_param)
    assert torch.equal(exp_avg, ref_exp_avg)
    assert torch.equal(exp_avg_sq, ref_exp_avg_sq)
    if out is not None:
        assert torch.equal(out, ref_param.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowp_chunk", [None, LOWP_CHUNK])
def test_lowp_out_is_param_rounded(dtype: torch.dtype, lowp_chunk: int | None) -> None:
    numel = 3 * LOWP_CHUNK + 123
    gen = torch.Generator().manual_seed(2)
    param, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    grad_before = grad.clone()
    out = torch.zeros(numel, dtype=dtype)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
    adam_step_(
        param, grad, torch.zeros(numel), torch.zeros(numel), 1, hyper,
        lowp_out=out, lowp_chunk=lowp_chunk,
    )  # fmt: skip
    assert torch.equal(out, param.to(dtype))
    assert torch.equal(grad, grad_before)  # the gradient is only read


def test_default_lowp_chunk_keeps_simd_alignment() -> None:
    # A split off the SIMD grid would route elements through the kernel's scalar tail.
    assert LOWP_CHUNK_PER_THREAD % CHUNK_ALIGN == 0


def _call(**overrides: object) -> None:
    operands: dict[str, object] = {
        "param": torch.zeros(32),
        "grad": torch.zeros(32),
        "exp_avg": torch.zeros(32),
        "exp_avg_sq": torch.zeros(32),
        "step": 1,
        "lowp_out": None,
        "lowp_chunk": None,
    }
    operands.update(overrides)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    options = {"lowp_out": operands.pop("lowp_out"), "lowp_chunk": operands.pop("lowp_chunk")}
    adam_step_(*operands.values(), hyper, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"grad": torch.zeros(31)}, ValueError, "grad has 31 elements"),
        ({"exp_avg_sq": torch.zeros(33)}, ValueError, "exp_avg_sq has 33 elements"),
        ({"lowp_out": torch.zeros(31, dtype=torch.bfloat16)}, ValueError, "lowp_out has 31"),
        ({"exp_avg": torch.zeros(64)[::2]}, ValueError, "flat and contiguous"),
        ({"param": torch.zeros(4, 8)}, ValueError, "flat and contiguous"),
        ({"step": 0}, ValueError, "at least 1"),
        ({"lowp_out": torch.zeros(32, dtype=torch.int16)}, TypeError, "floating point"),
        ({"grad": torch.zeros(32, dtype=torch.float64)}, TypeError, "grad is torch.float64"),
        (
            {"lowp_out": torch.zeros(32, dtype=torch.bfloat16), "lowp_chunk": CHUNK_ALIGN + 1},
            ValueError,
            "multiple of",
        ),
    ],
)
def test_invalid_operands_raise(
    overrides: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _call(**overrides)

"""Optimizer math on flat tensors against independent references."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.training import ReferenceLamb
from zerotrain.optim import SGD, Adam, Lamb
from zerotrain.optim.clip import clip_coefficient, global_grad_norm

SHAPES = [(4, 3), (5,), (2, 2)]


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _flat(tensors: list[torch.Tensor], pad: int = 0) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(pad)])


def _run_flat(opt_cls, steps: int = 5, pad: int = 0, **kwargs) -> torch.Tensor:
    flat = _flat(_params(), pad)
    spans, start = [], 0
    for pid, s in enumerate(SHAPES):
        n = torch.Size(s).numel()
        spans.append((start, start + n, pid))
        start += n
    group = {"params": [flat]}
    if opt_cls is Lamb:
        group["segments"] = [tuple(spans)]
        group["num_ids"] = len(SHAPES)
    opt = opt_cls([group], **kwargs)
    for step in range(steps):
        flat.grad = _flat(_grads(step), pad)
        opt.step()
    return flat


def _run_reference(opt_factory, steps: int = 5) -> torch.Tensor:
    params = [torch.nn.Parameter(p) for p in _params()]
    opt = opt_factory(params)
    for step in range(steps):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()
    return _flat([p.detach() for p in params])


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_matches_torch(amsgrad, decoupled):
    got = _run_flat(Adam, lr=0.01, weight_decay=0.1, amsgrad=amsgrad, adam_w_mode=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = _run_reference(lambda p: cls(p, lr=0.01, weight_decay=0.1, amsgrad=amsgrad))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_without_bias_correction(decoupled):
    got = _run_flat(Adam, lr=0.01, weight_decay=0.1, bias_correction=False, adam_w_mode=decoupled)
    params = _params()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(5):
        for p, g, mi, vi in zip(params, _grads(step), m, v, strict=True):
            if not decoupled:
                g = g + 0.1 * p
            mi.mul_(0.9).add_(0.1 * g)
            vi.mul_(0.999).add_(0.001 * g * g)
            if decoupled:
                p.mul_(1 - 0.01 * 0.1)
            p.sub_(0.01 * mi / (vi.sqrt() + 1e-8))
    torch.testing.assert_close(got, _flat(params), rtol=0, atol=1e-6)


def test_sgd_matches_torch():
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}
    got = _run_flat(SGD, **kwargs)
    ref = _run_reference(lambda p: torch.optim.SGD(p, **kwargs))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_lamb_uses_a_trust_ratio_per_original_parameter():
    got = _run_flat(Lamb, pad=3, lr=0.01, weight_decay=0.1, min_coeff=0.01, max_coeff=10.0)
    ref = _run_reference(lambda p: ReferenceLamb(p, lr=0.01, weight_decay=0.1))
    torch.testing.assert_close(got[:-3], ref, rtol=0, atol=1e-6)
    assert torch.equal(got[-3:], torch.zeros(3)), "padding must never be updated"


def test_lamb_partial_norms_are_reduced_through_the_callback():
    seen = []

    def reducer(squares: torch.Tensor) -> None:
        seen.append(squares.shape)

    flat = _flat(_params())
    segments = [((0, 12, 0), (12, 17, 1), (17, 21, 2))]
    opt = Lamb([{"params": [flat], "segments": segments, "num_ids": 3}], norm_reducer=reducer)
    flat.grad = _flat(_grads(0))
    opt.step()
    assert seen == [torch.Size([2, 3])]  # weight and update norms of 3 parameters


def test_lamb_requires_segments():
    with pytest.raises(ValueError, match="segments"):
        Lamb([torch.zeros(4)])


def test_zero_grad_follows_torch_set_to_none():
    # The engine binds the pieces' gradients again before each step, and reads dropped ones
    # as "the user cleared the gradients" (tests/dist/test_gan.py).
    flat = torch.zeros(4)
    grad = torch.ones(4)
    flat.grad = grad
    opt = Adam([flat])
    opt.zero_grad(set_to_none=False)
    assert flat.grad is grad
    assert torch.equal(grad, torch.zeros(4))
    opt.zero_grad()
    assert flat.grad is None


def test_clip_matches_torch_clip_grad_norm():
    params = [torch.nn.Parameter(p) for p in _params()]
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g * 10
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params, strict=True):
        r.grad = p.grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    grads = [p.grad for p in params]
    norm, coef = clip_coefficient(global_grad_norm(grads), 1.0, 1.0)
    assert coef is not None
    torch._foreach_mul_(grads, coef)
    torch.testing.assert_close(norm, ref_norm)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_norm_reduces_fp64_partial_squares_and_clip_off_applies_nothing():
    grads = [torch.full((4,), 3.0)]
    calls = []
    norm = global_grad_norm(grads, reduce_partial=lambda sq: (calls.append(sq.dtype), sq.mul_(2)))
    assert calls == [torch.float64]
    assert norm.item() == pytest.approx((2 * 36) ** 0.5)
    assert norm.dtype == torch.float32
    assert clip_coefficient(norm, 1.0, 0.0)[1] is None  # clipping off: nothing to apply


def test_lamb_parameter_split_across_tensors_uses_one_trust_ratio():
    # As with ZeRO sharding: parameter 1 (elements 12..17) is split between two tensors.
    whole = _run_flat(Lamb, lr=0.01, weight_decay=0.1)
    flat = _flat(_params())
    left, right = flat[:14].clone(), flat[14:].clone()
    segments = [((0, 12, 0), (12, 14, 1)), ((0, 3, 1), (3, 7, 2))]
    opt = Lamb(
        [{"params": [left, right], "segments": segments, "num_ids": 3}], lr=0.01, weight_decay=0.1
    )
    for step in range(5):
        grad = _flat(_grads(step))
        left.grad, right.grad = grad[:14].clone(), grad[14:].clone()
        opt.step()
    torch.testing.assert_close(torch.cat([left, right]), whole, rtol=0, atol=1e-7)

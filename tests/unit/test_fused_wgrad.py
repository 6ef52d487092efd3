"""The accumulating linear of ``zero/fused_wgrad.py`` on its own: where it adds the weight
gradient in place, the sum equals autograd's and hooks run as autograd runs them; wherever
that could differ (a refusal, a user's gradient hook, autocast, a double backward, a tied
or small weight, a subclass) autograd's own path runs."""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.zero.fused_wgrad import WeightGradFusion


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4, bias=False))


def _always(weight: torch.Tensor) -> bool:
    return weight.grad is not None


def _grads_by_autograd(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    reference = _model()
    reference.load_state_dict(model.state_dict())
    for x in inputs:
        reference(x).square().sum().backward()
    return [p.grad.clone() for p in reference.parameters()]


def test_in_place_sum_equals_autograds_and_keeps_the_storage() -> None:
    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)
    assert fusion.layers == [model[0], model[2]]
    inputs = [torch.randn(2, 3, 6) for _ in range(3)]  # batch and sequence dimensions
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    storages = [p.grad.data_ptr() for p in model.parameters()]
    with torch.profiler.profile() as prof:
        for x in inputs:
            model(x).square().sum().backward()
    in_place = [e for e in prof.events() if e.name == "aten::addmm_"]
    assert len(in_place) == 2 * len(inputs)  # each weight, each backward
    for got, want in zip(model.parameters(), _grads_by_autograd(model, inputs), strict=True):
        torch.testing.assert_close(got.grad, want, rtol=1e-6, atol=1e-6)
    assert [p.grad.data_ptr() for p in model.parameters()] == storages


def test_post_accumulate_hooks_run_once_per_backward() -> None:
    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)  # layers reach it weakly: keep it
    seen: list[int] = []
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        p.register_post_accumulate_grad_hook(lambda t: seen.append(id(t)))
    model(torch.randn(4, 6)).sum().backward()
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    assert fusion.layers


def test_refused_weights_take_autograds_path() -> None:
    model = _model()
    asked: list[torch.Tensor] = []
    fusion = WeightGradFusion(model, lambda w: bool(asked.append(w)), smallest=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = [torch.randn(4, 6)]
    model(inputs[0]).square().sum().backward()  # every weight refused: autograd adds
    assert [id(w) for w in asked] == [id(model[2].weight), id(model[0].weight)]
    assert fusion.layers
    for got, want in zip(model.parameters(), _grads_by_autograd(model, inputs), strict=True):
        torch.testing.assert_close(got.grad, want, rtol=1e-6, atol=1e-6)


def test_a_users_gradient_hook_sees_the_gradient() -> None:
    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)
    fusion._own_pre_hooks = 0  # no engine here: any pre-hook is a user's
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    seen: list[torch.Tensor] = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    x = torch.randn(4, 6)
    model(x).square().sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], _grads_by_autograd(model, [x])[0])


def test_autocast_and_double_backward_keep_autograds_path() -> None:
    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 6))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()

    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(4, 6, requires_grad=True)
    (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    gx.sum().backward()  # second order through the layer's weights
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    assert fusion.layers


def test_tied_small_and_subclassed_layers_are_left_alone() -> None:
    class Scaled(nn.Linear):
        pass

    head = nn.Linear(8, 8)
    embed = nn.Embedding(8, 8)
    embed.weight = head.weight  # tied
    model = nn.Sequential(embed, head, Scaled(8, 8), nn.Linear(8, 8), nn.Linear(2, 2))
    fusion = WeightGradFusion(model, _always, smallest=64)
    assert fusion.layers == [model[3]]
    fusion.remove()
    assert "forward" not in vars(model[3])
    assert fusion.layers == []


def test_a_pickled_or_copied_model_gets_plain_layers() -> None:
    import copy
    import io
    import pickle

    model = _model()
    fusion = WeightGradFusion(model, _always, smallest=1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 6)
    for other in (loaded, twin, pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(other(x), model(x))
        other(x).sum().backward()  # autograd's path: no engine behind the copy
    assert fusion.layers

"""PipelineModule in one process: partitioning, per-stage building, seeding, ties and chunks.

Every stage is built here with ``stage_id=``, so running all stages' chunks in order on one
process must reproduce the single-stage module exactly.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from zerotrain.comm.env import current_rank_and_world
from zerotrain.examples.gpt import GPT, GPTConfig, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.parallel.pipeline.partition import (
    layer_weights,
    partition_balanced,
    partition_uniform,
)
from zerotrain.parallel.topology import Topology
from zerotrain.pipe import LayerSpec, PipelineModule, TiedLayerSpec

# -- partitioning ---------------------------------------------------------------------------


def _brute_force_bottleneck(weights: list[float], parts: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_partition_balanced_is_exact_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [float(rng.choice([0, 0, 1, 2, 3, 7, 50])) for _ in range(n)]
        bounds = partition_balanced(weights, parts)
        assert len(bounds) == parts + 1
        assert (bounds[0], bounds[-1]) == (0, n)
        assert all(a < b for a, b in itertools.pairwise(bounds)), (weights, bounds)  # non-empty
        got = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        assert got == _brute_force_bottleneck(weights, parts), (weights, parts, bounds)


def test_partition_balanced_spreads_what_the_bottleneck_leaves() -> None:
    assert partition_balanced([1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 6, 8]
    assert partition_balanced([0.0] * 6, 3) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="cannot cut 2 layer"):
        partition_balanced([1, 1], 3)
    with pytest.raises(ValueError, match="finite and >= 0"):
        partition_balanced([1, -1], 1)


def test_partition_uniform_gives_the_remainder_to_the_first_parts() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="at least as many layers"):
        partition_uniform(3, 4)


def _frozen_linear() -> nn.Linear:
    layer = nn.Linear(2, 2)
    layer.bias.requires_grad_(False)
    return layer


def test_layer_weights_methods() -> None:
    layers = [LayerSpec(nn.Linear, 3, 4), _frozen_linear(), torch.tanh, LayerSpec(nn.ReLU)]
    assert layer_weights(layers, "parameters") == [16.0, 4.0, 0.0, 0.0]
    assert layer_weights(layers, "uniform") == [1.0] * 4
    # DeepSpeed's type: regex is a case-insensitive search of the class (or function) name.
    assert layer_weights(layers, "type:LINEAR") == [1.0, 1.0, 0.0, 0.0]
    assert layer_weights(layers, "type:^tanh$") == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"no layer's class name matches 'Block'.*Linear, ReLU"):
        layer_weights(layers, "type:Block")
    with pytest.raises(ValueError, match=r"allowed methods are parameters, uniform, type:REGEX"):
        layer_weights(layers, "profile")


# -- building only the local layers ----------------------------------------------------------


class Counted(nn.Module):
    """A layer that records every construction whose parameters are real (not meta)."""

    real_builds: list[int] = []  # noqa: RUF012 - reset by the test that reads it

    def __init__(self, tag: int, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        if not self.lin.weight.is_meta:
            Counted.real_builds.append(tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _counted_layers(n: int = 8) -> list[LayerSpec]:
    return [LayerSpec(Counted, i) for i in range(n)]


def test_a_stage_builds_only_its_own_specs_for_real() -> None:
    Counted.real_builds.clear()
    module = PipelineModule(
        _counted_layers(), num_stages=2, stage_id=1, partition_method="parameters"
    )
    assert module.parts == [0, 4, 8]
    assert Counted.real_builds == [4, 5, 6, 7]  # the others were built on meta only
    Counted.real_builds.clear()


def test_parameter_names_use_global_layer_indices() -> None:
    module = PipelineModule(_counted_layers(), num_stages=2, stage_id=1)
    names = [name for name, _ in module.named_parameters()]
    assert names[0] == "4.lin.weight"
    assert {name.split(".")[0] for name in names} == {"4", "5", "6", "7"}
    assert (module.is_first_stage, module.is_last_stage, module.local_chunks()) == (
        False,
        True,
        [1],
    )


def test_modules_given_directly_are_kept_only_on_their_stage() -> None:
    layers = [nn.Linear(4, 4) for _ in range(4)]
    first = PipelineModule(layers, num_stages=2, stage_id=0, partition_method="uniform")
    assert [name for name, _ in first.named_children()] == ["tied_modules", "0", "1"]
    assert first.get_submodule("1") is layers[1]


def test_seed_layers_gives_values_independent_of_the_number_of_stages() -> None:
    before = torch.get_rng_state()
    whole = PipelineModule(_counted_layers(), num_stages=1, seed_layers=True, base_seed=7)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is untouched
    second = PipelineModule(
        _counted_layers(), num_stages=2, stage_id=1, seed_layers=True, base_seed=7
    )
    reference = whole.state_dict()
    for name, value in second.state_dict().items():
        assert torch.equal(value, reference[name]), name
    calls: list[int] = []
    PipelineModule(
        _counted_layers(4), num_stages=2, stage_id=0, seed_layers=True, seed_fn=calls.append
    )
    assert calls == [1234, 1235]


# -- ties -----------------------------------------------------------------------------------


def _transpose_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def _tied_layers() -> list[object]:
    return [
        TiedLayerSpec("embed", nn.Embedding, 10, 4),
        LayerSpec(nn.Linear, 4, 4),
        LayerSpec(nn.Linear, 4, 4),
        TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=_transpose_head),
    ]


def test_tied_layers_live_on_each_stage_that_uses_them_with_equal_values() -> None:
    stages = [
        PipelineModule(
            _tied_layers(), num_stages=3, stage_id=s, seed_layers=True, partition_method="uniform"
        )
        for s in range(3)
    ]
    first, middle, last = stages
    assert first.parts == [0, 2, 3, 4]
    assert [first.tied_keys_of_stage(s) for s in range(3)] == [{"embed"}, set(), {"embed"}]
    assert "tied_modules.embed.weight" in dict(last.named_parameters())
    assert torch.equal(first.tied_modules["embed"].weight, last.tied_modules["embed"].weight)
    assert first.tied_weight_params("embed") == [first.tied_modules["embed"].weight]
    with pytest.raises(KeyError, match="not on stage 1"):
        middle.tied_weight_params("embed")
    x = torch.randn(3, 4)
    weight = last.tied_modules["embed"].weight
    torch.testing.assert_close(last(x), x @ weight.t())  # forward_fn ran, not Embedding


def test_tied_weight_attr_is_normalised_and_nested_attrs_resolve() -> None:
    assert TiedLayerSpec("k", nn.Linear, 2, 2, tied_weight_attr="bias").tied_weight_attr == (
        "bias",
    )
    layers = [
        TiedLayerSpec("k", nn.Sequential, nn.Linear(2, 2), tied_weight_attr=["0.weight", "0.bias"])
    ]
    module = PipelineModule(layers, num_stages=1)
    inner = module.tied_modules["k"][0]
    assert module.tied_weight_params("k") == [inner.weight, inner.bias]
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        LayerSpec(torch.tanh)  # type: ignore[arg-type]
    assert repr(LayerSpec(nn.Linear, 2, 3, bias=False)) == "LayerSpec(Linear, 2, 3, bias=False)"


# -- running chunks -------------------------------------------------------------------------


def test_interleaved_chunks_of_all_stages_reproduce_the_whole_model() -> None:
    def build(stage: int | None, stages: int, virtual: int) -> PipelineModule:
        return PipelineModule(
            _counted_layers(),
            num_stages=stages,
            stage_id=stage,
            virtual_stages=virtual,
            seed_layers=True,
        )

    whole = build(None, 1, 1)
    ranks = [build(s, 2, 2) for s in range(2)]
    assert ranks[0].local_chunks() == [0, 2]
    assert ranks[1].local_chunks() == [1, 3]
    assert ranks[0].chunk_layers(2) == range(4, 6)
    assert {n.split(".")[0] for n, _ in ranks[0].named_parameters()} == {"0", "1", "4", "5"}
    assert ranks[0].is_first_stage
    assert ranks[1].is_last_stage
    x = torch.randn(3, 4)
    y = x
    for chunk in range(4):  # chunk c runs on rank c % 2, as its local chunk c // 2
        y = ranks[chunk % 2](y, chunk=chunk // 2)
    torch.testing.assert_close(y, whole(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"numbered 0\.\.1"):
        ranks[0](x, chunk=2)
    lines = ranks[0].describe_partition().splitlines()
    assert len(lines) == 4
    assert lines[2] == "chunk 2 (stage 0): layers 4-5, 40 trainable parameters: Counted, Counted"


def _pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x > 0


def _masked(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, mask = pair  # a tuple arrives as one argument
    return x * mask


def _bad(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": x}


def test_tuples_pass_as_one_argument_and_other_outputs_are_refused() -> None:
    module = PipelineModule([nn.Linear(3, 3), _pair, _masked], num_stages=1)
    x = torch.randn(2, 3)
    inner = module.get_submodule("0")(x)
    torch.testing.assert_close(module(x), inner.clamp(min=0))
    broken = PipelineModule([nn.Linear(3, 3), _bad, _masked], num_stages=1)
    with pytest.raises(TypeError, match=r"pipeline layer 1 \(_bad\) returned dict"):
        broken(x)


def test_activation_checkpointing_matches_plain_gradients() -> None:
    calls: list[int] = []

    def counting(fn, *args):  # type: ignore[no-untyped-def]
        calls.append(len(args))
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def run(interval: int) -> list[torch.Tensor]:
        module = PipelineModule(
            [*_counted_layers(5), _pair, _masked],
            num_stages=1,
            seed_layers=True,
            activation_checkpoint_interval=interval,
            activation_checkpoint_func=counting,
        )
        module(torch.randn(2, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
        return [p.grad for p in module.parameters()]

    plain = run(0)
    assert calls == []
    checkpointed = run(2)
    # Groups [0, 1] [2, 3] [4, _pair] [_masked]. The first group's input needs no gradient but
    # its parameters do, so it is checkpointed too; the last gets the tuple splatted.
    assert calls == [1, 1, 1, 2]
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    calls.clear()
    with torch.no_grad():
        PipelineModule(
            _counted_layers(2),
            num_stages=1,
            activation_checkpoint_interval=1,
            activation_checkpoint_func=counting,
        )(torch.randn(2, 4))
    assert calls == []  # nothing to recompute for


# -- placement ------------------------------------------------------------------------------


def test_stage_comes_from_stage_id_topology_or_the_process_group() -> None:
    assert current_rank_and_world() == (0, 1)  # no process group in unit tests
    single = PipelineModule(_counted_layers(2), num_stages=1)
    assert (single.stage_id, single.topology) == (0, Topology(pipe=1))
    grid = Topology(pipe=2, data=2)
    module = PipelineModule(_counted_layers(2), topology=grid, stage_id=1)
    assert (module.num_stages, module.stage_id, module.topology) == (2, 1, grid)
    with pytest.raises(ValueError, match="needs num_stages= or topology="):
        PipelineModule(_counted_layers(2))
    with pytest.raises(ValueError, match="num_stages=3 but topology"):
        PipelineModule(_counted_layers(4), num_stages=3, topology=grid, stage_id=0)
    with pytest.raises(ValueError, match=r"stage_id=2; the stages are 0..1"):
        PipelineModule(_counted_layers(2), num_stages=2, stage_id=2)
    with pytest.raises(ValueError, match="pass stage_id= to build one stage"):
        PipelineModule(_counted_layers(2), num_stages=2)
    with pytest.raises(ValueError, match="has 4 ranks but the job has 1"):
        PipelineModule(_counted_layers(2), topology=grid)
    with pytest.raises(ValueError, match="cannot fill 2 stage"):
        PipelineModule(_counted_layers(3), num_stages=2, stage_id=0, virtual_stages=2)
    with pytest.raises(TypeError, match="must be a LayerSpec"):
        PipelineModule([nn.Linear(2, 2), 3], num_stages=1)


# -- the demo GPT as a layer list -----------------------------------------------------------

_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _gpt_stage(stage: int | None, stages: int) -> PipelineModule:
    return PipelineModule(
        gpt_pipeline_layers(_GPT),
        num_stages=stages,
        stage_id=stage,
        seed_layers=True,
        loss_fn=gpt_loss_fn,
    )


def test_gpt_layer_list_is_the_gpt_model() -> None:
    whole = _gpt_stage(None, 1)
    idx = torch.randint(0, _GPT.vocab_size, (3, 8), generator=torch.Generator().manual_seed(1))
    logits = whole(idx)
    assert logits.shape == (3, 8, _GPT.vocab_size)
    # Same architecture: the GPT class loaded with the layer list's values gives the logits.
    last = _GPT.n_layer + 1
    renamed = {"ln_f.weight": f"{last}.weight", "ln_f.bias": f"{last}.bias"}
    renamed |= {
        "wte.weight": "tied_modules.embed.token.weight",
        "lm_head.weight": "tied_modules.embed.token.weight",
    }
    renamed["wpe.weight"] = "tied_modules.embed.position.weight"
    state = whole.state_dict()
    gpt = GPT(_GPT)
    gpt.load_state_dict(
        {
            name: state[
                renamed.get(name) or f"{int(name.split('.')[1]) + 1}.{name.split('.', 2)[2]}"
            ]
            for name in gpt.state_dict()
        }
    )
    torch.testing.assert_close(gpt(idx), logits)


def test_gpt_stages_compose_and_share_the_tied_embedding() -> None:
    whole, first, last = _gpt_stage(None, 1), _gpt_stage(0, 2), _gpt_stage(1, 2)
    assert first.parts == [0, 2, 5]  # embedding + block | block + norm + head
    assert first.tied_keys_of_stage(1) == {"embed"}
    tied = "tied_modules.embed.token.weight"
    assert torch.equal(first.state_dict()[tied], last.state_dict()[tied])
    idx = torch.randint(0, _GPT.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(idx, -1, dims=1)
    loss = gpt_loss_fn(last(first(idx)), targets)
    torch.testing.assert_close(loss, whole.loss_fn(whole(idx), targets))
    loss.backward()
    whole.loss_fn(whole(idx), targets).backward()
    # The tied weight's gradient is the sum over the stages that use it.
    (a,), (b,) = first.tied_weight_params("embed"), last.tied_weight_params("embed")
    torch.testing.assert_close(a.grad + b.grad, whole.tied_weight_params("embed")[0].grad)


def test_gpt_first_stage_checkpoints_with_token_ids_as_input() -> None:
    # The default checkpoint function (zerotrain.checkpointing.checkpoint) on a stage whose
    # input is integer token ids: the parameters' gradients equal the plain run's.
    idx = torch.randint(0, _GPT.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    grads = []
    for interval in (0, 1):
        stage = PipelineModule(
            gpt_pipeline_layers(_GPT),
            num_stages=2,
            stage_id=0,
            seed_layers=True,
            activation_checkpoint_interval=interval,
        )
        stage(idx).square().mean().backward()
        grads.append({n: p.grad for n, p in stage.named_parameters()})
    assert all(g is not None for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_a_launched_process_without_its_group_is_told_to_initialize_first(monkeypatch):
    # torchrun started 2 processes but the process group is not up: building a stage now
    # would take this process for rank 0 of 1.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"zerotrain.init_distributed\(\) first"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)], num_stages=2)


# DeepSpeedExamples' AlexNet (training/pipeline_parallelism): trainable parameters per
# layer entry: conv, ReLU, pool, conv, ReLU, pool, conv, ReLU, conv, ReLU, conv, ReLU, pool,
# flatten, dropout, linear, ReLU, dropout, linear, ReLU, linear.
_ALEXNET = [
    23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0,
    37752832, 0, 0, 16781312, 0, 40970,
]  # fmt: skip


def test_weightless_layers_end_the_stage_before_as_in_deepspeed() -> None:
    """DeepSpeed's partition_balanced puts the ReLU, pooling and dropout after a stage's
    last weighted layer at the end of that stage; zerotrain put the boundary before them,
    so AlexNet's stage 1 began with ReLU(inplace=True) on a received tensor."""
    assert partition_balanced(_ALEXNET, 2) == [0, 18, 21]  # DeepSpeed's parts at -p 2
    assert partition_balanced(_ALEXNET, 3) == [0, 15, 18, 21]  # and at -p 3
    # Every part still starts with a weighted layer when it has one, the bottleneck is
    # unchanged, and a part without weight keeps its items spread by count.
    assert partition_balanced([5, 0, 0, 5, 0], 2) == [0, 3, 5]
    assert partition_balanced([5, 0, 0, 0], 2) == [0, 2, 4]

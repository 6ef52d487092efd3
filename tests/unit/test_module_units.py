"""Choosing stage-3 units from a model's structure."""

from __future__ import annotations

import pytest
from torch import nn

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.zero.module_units import plan_module_units

TINY = GPTConfig(block_size=8, n_layer=3, n_head=2, n_embd=16)


def test_repeated_blocks_are_units_and_the_rest_is_the_root():
    model = GPT(TINY)
    blocks, root = plan_module_units(model)
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert root is not None
    assert root.label == "<root>"
    # The tied embedding/head weight is one parameter, in the root unit.
    root_names = [n for n, _ in root.params]
    assert "wte.weight" in root_names
    assert "lm_head.weight" not in root_names
    total = sum(b.numel for b in blocks) + root.numel
    assert total == sum(p.numel() for p in model.parameters())


def test_a_parameter_shared_between_a_block_and_the_root_goes_to_the_root():
    model = GPT(TINY)
    model.blocks[1].mlp.fc.weight = model.blocks[0].mlp.fc.weight  # shared by two blocks
    blocks, root = plan_module_units(model)
    assert root is not None
    assert "blocks.0.mlp.fc.weight" in [n for n, _ in root.params]
    for block in blocks[:2]:
        assert all("mlp.fc.weight" not in n for n, _ in block.params)
    assert "blocks.2.mlp.fc.weight" in [n for n, _ in blocks[2].params]


def test_classes_override_the_choice():
    model = GPT(TINY)
    blocks, root = plan_module_units(model, ["MLP", "CausalSelfAttention"])
    assert [b.name for b in blocks][:2] == ["blocks.0.attn", "blocks.0.mlp"]
    assert len(blocks) == 6
    assert root is not None
    assert any(n.startswith("blocks.0.ln1") for n, _ in root.params)


def test_unknown_class_names_are_an_error_listing_the_classes():
    with pytest.raises(ValueError, match=r"matches no module of the model.*Block"):
        plan_module_units(GPT(TINY), ["Blok"])


def test_heterogeneous_lists_and_single_children_are_not_blocks():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    blocks, root = plan_module_units(model)
    assert blocks == []
    assert root is not None
    assert len(root.params) == 4


def test_lists_of_containers_are_searched_not_made_units():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleDict({"fc": nn.Linear(2, 2), "gate": nn.Linear(2, 1)})

    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(2, 2)}) for _ in range(3))
    model.stack = nn.ModuleList(Layer() for _ in range(2))
    blocks, _ = plan_module_units(model)
    assert [b.name for b in blocks] == ["stack.0", "stack.1"]  # ModuleDicts are never called


def test_naming_the_models_own_class_is_explained():
    with pytest.raises(ValueError, match="names the model's own class 'GPT'"):
        plan_module_units(GPT(TINY), ["GPT"])

"""Progressive layer drop, curriculum and random-LTD: the formulas against values computed
independently here, the config sections' checks, truncation, and the block wrappers'
arithmetic (single process; the engine-level parity tests are in
tests/dist/test_training_efficiency.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from zerotrain.config.errors import ConfigError
from zerotrain.config.features import not_implemented
from zerotrain.config.loader import load_config
from zerotrain.efficiency.blocks import find_block_stack
from zerotrain.efficiency.curriculum import truncate_call
from zerotrain.efficiency.draws import shared_generator
from zerotrain.efficiency.layer_drop import (
    ProgressiveLayerDrop,
    apply_layer_drop,
    remove_layer_drop,
)
from zerotrain.efficiency.random_ltd import RandomLTD, apply_random_ltd
from zerotrain.efficiency.schedules import (
    CurriculumSchedule,
    RandomLTDSchedule,
    keep_probability,
    pld_theta,
)
from zerotrain.examples.gpt import GPT, GPTConfig

BASE = {"train_batch_size": 4}

# -- progressive layer drop ---------------------------------------------------------------------


@pytest.mark.parametrize("theta", [0.0, 0.1, 0.9, 1.0])
def test_pld_theta_matches_deepspeeds_formula_test(theta):
    # DeepSpeed 0.19.5 tests/unit/runtime/test_pld.py: update_state(i), then theta equals
    # (1 - theta) * exp(-gamma * i) + theta exactly.
    gamma = 0.001
    pld = ProgressiveLayerDrop(theta, gamma)
    assert pld.get_theta() == 1.0  # before any step
    for i in range(10):
        pld.update_state(i)
        assert pld.get_theta() == (1.0 - theta) * np.exp(-gamma * i) + theta
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}


def test_pld_keep_probabilities():
    # 1 - l/L * (1 - theta) for l = 1..L: the last layer keeps theta.
    assert [keep_probability(n, 4, 0.5) for n in range(1, 5)] == [0.875, 0.75, 0.625, 0.5]
    assert keep_probability(3, 3, 0.2) == pytest.approx(0.2)
    assert pld_theta(0, 0.3, 5.0) == 1.0
    with pytest.raises(ValueError, match=r"not in 1\.\.4"):
        keep_probability(0, 4, 0.5)


def _tiny_gpt(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, n_layer=layers, n_head=2, n_embd=16, bias=False))


def test_layer_drop_forward_is_identity_or_rescaled_and_skips_hooks():
    model = _tiny_gpt()
    reference = copy.deepcopy(model)
    pld = ProgressiveLayerDrop(theta=0.5, gamma=10.0)
    pld.update_state(5)  # theta ~ 0.5: keep probabilities 0.875 .. 0.5
    apply_layer_drop(list(model.blocks), pld)
    calls = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    idx = torch.randint(0, 256, (2, 16))
    kept = None
    for micro_step in range(40):  # find a draw that drops some and keeps some
        pld.begin_forward(micro_step)
        kept = [pld.decision(i)[0] for i in range(4)]
        if 0 < sum(kept) < 4:
            break
    assert kept is not None
    assert 0 < sum(kept) < 4
    out = model(idx)
    assert calls == [i for i in range(4) if kept[i]]  # dropped blocks fire no hook
    x = reference.drop(reference.wte(idx) + reference.wpe(torch.arange(16)))
    for i, block in enumerate(reference.blocks):
        p = 1 - (i + 1) / 4 * (1 - pld.get_theta())
        if kept[i]:
            x = x + (block(x) - x) / p
    expected = reference.lm_head(reference.ln_f(x))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Evaluation runs every block, unscaled.
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)
    # state_dict keys and class names are those of the plain model.
    assert list(model.state_dict()) == list(reference.state_dict())
    assert type(model.blocks[0]).__name__ == "Block"
    remove_layer_drop(list(model.blocks))
    assert type(model.blocks[0]) is type(reference.blocks[0])


def test_layer_drop_draws_are_seeded_per_micro_step():
    a, b = ProgressiveLayerDrop(0.5, 10.0, seed=3), ProgressiveLayerDrop(0.5, 10.0, seed=3)
    for pld in (a, b):
        pld.update_state(100)
        pld.blocks = [nn.Identity() for _ in range(8)]
    torch.manual_seed(1)
    first = a.begin_forward(7)
    torch.manual_seed(2)  # the global RNG plays no part
    second = b.begin_forward(7)
    assert [a.blocks.index(m) for m in first] == [b.blocks.index(m) for m in second]
    draws = torch.rand(8, generator=shared_generator(3, 1, 7))
    probs = [1 - (i + 1) / 8 * 0.5 for i in range(8)]
    assert [a.blocks.index(m) for m in first] == [i for i in range(8) if draws[i] >= probs[i]]


def _hf_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=16,
            n_layer=4,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
    )
    return {"gpt2": gpt2, "llama": llama}


class _ManualDrop(nn.Module):
    """The reference: the block's residual update kept and scaled by 1/p, or skipped."""

    def __init__(self, block: nn.Module, kept: bool, prob: float):
        super().__init__()
        self.block, self.kept, self.prob = block, kept, prob

    def forward(self, hidden_states, *args, **kwargs):
        if not self.kept:
            return hidden_states
        out = self.block(hidden_states, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return hidden_states + (out - hidden_states) / self.prob


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_layer_drop_on_transformers_blocks(name):
    torch.manual_seed(0)
    model = _hf_models()[name]
    path, stack = find_block_stack(model, [], "progressive_layer_drop")
    assert len(stack) == 4
    reference = copy.deepcopy(model)
    pld = ProgressiveLayerDrop(theta=0.3, gamma=10.0)
    pld.update_state(5)
    apply_layer_drop(list(stack), pld)
    model.train()
    reference.train()
    micro_step = next(s for s in range(100) if 0 < len(pld.begin_forward(s)) < 4)
    pld.begin_forward(micro_step)
    ref_stack = reference.get_submodule(path)
    for i in range(4):
        kept, prob = pld.decision(i)
        ref_stack[i] = _ManualDrop(ref_stack[i], kept, prob)
    ids = torch.randint(0, 64, (2, 12))
    got = model(input_ids=ids, labels=ids)
    want = reference(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    got.loss.backward()
    dropped = [i for i in range(4) if not pld.decision(i)[0]]
    for i in dropped:  # no gradient reaches a dropped block
        assert all(p.grad is None for p in stack[i].parameters())


def test_find_block_stack_errors():
    with pytest.raises(ValueError, match="block_types"):
        find_block_stack(nn.Sequential(nn.Linear(2, 2)), [], "progressive_layer_drop")
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    _, stack = find_block_stack(model, ["Linear"], "progressive_layer_drop")
    assert len(stack) == 3


# -- curriculum ---------------------------------------------------------------------------------


def _root_value(step, total, low, high, multiple, degree):
    # Written out again from DeepSpeed's description: the root curve, floored, rounded down
    # to the multiple, capped.
    value = int((step / total) ** (1 / degree) * (high - low) + low)
    return min(value - value % multiple, high)


def test_curriculum_fixed_linear_values():
    s = CurriculumSchedule(8, 64, "fixed_linear", total_step=10, difficulty_step=8)
    # Hand-computed: step 1 -> 8 + 5.6 = 13 -> 8; step 5 -> 8 + 28 = 36 -> 32; 10 -> 64.
    assert [s.update(t) for t in (1, 5, 9, 10, 11)] == [8, 32, 56, 64, 64]
    s = CurriculumSchedule(72, 2048, "fixed_linear", total_step=221108, difficulty_step=8)
    for t in (1, 1000, 50_000, 221_107, 221_108):
        assert s.difficulty_at(t) == _root_value(t, 221108, 72, 2048, 8, 1)


def test_curriculum_fixed_root_values():
    s = CurriculumSchedule(8, 64, "fixed_root", total_step=10, difficulty_step=8, root_degree=2)
    # sqrt(0.1) * 56 = 17.7 -> 25 -> 24; sqrt(0.4) * 56 = 35.4 -> 43 -> 40.
    assert s.update(1) == 24
    assert s.update(4) == 40
    for t in range(1, 12):
        assert s.difficulty_at(t) == _root_value(t, 10, 8, 64, 8, 2)


def test_curriculum_fixed_discrete_and_custom():
    s = CurriculumSchedule(1, 3, "fixed_discrete", difficulty=[1, 2, 3], max_step=[5, 10])
    assert [s.difficulty_at(t) for t in (1, 5, 6, 10, 11, 100)] == [1, 1, 2, 2, 3, 3]
    s = CurriculumSchedule(8, 32, "custom")
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        s.update(1)
    s.set_custom(lambda step: 8 * step)
    assert [s.update(t) for t in (1, 2, 4, 5)] == [8, 16, 32, 32]  # stops at max


def test_curriculum_stops_updating_at_max():
    s = CurriculumSchedule(8, 16, "fixed_discrete", difficulty=[16, 8], max_step=[1])
    assert s.update(1) == 16
    assert s.update(5) == 16  # DeepSpeed: no recomputation once max is reached


def test_truncate_call_cuts_inputs_labels_and_masks_together():
    ids, labels = torch.arange(20).reshape(2, 10), torch.arange(20).reshape(2, 10) + 1
    mask = torch.ones(2, 1, 10, 10)
    args, kwargs = truncate_call((ids,), {"labels": labels, "mask": mask, "n": 3}, 4)
    assert args[0].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert kwargs["labels"].shape == (2, 4)
    assert kwargs["mask"].shape == (2, 1, 4, 4)
    assert kwargs["n"] == 3
    same = truncate_call((ids,), {}, 16)
    assert same[0][0] is ids


# -- random-LTD ---------------------------------------------------------------------------------


def test_random_ltd_schedule_values_and_layer_tokens():
    # The shared peer config: 128 -> 1024 tokens over 400 steps in multiples of 8.
    s = RandomLTDSchedule(128, 1024, 400, 8, total_layers=24, ltd_layers=22, global_batch_size=4)
    assert s.update(0) == 128
    assert s.consumed_layer_tokens == 4 * (128 * 22 + 1024 * 2)
    assert s.update(0) == 128
    assert s.consumed_layer_tokens == 4 * (128 * 22 + 1024 * 2)
    # 100/400 * 896 = 224 -> 352; 333/400 * 896 = 745.9 -> 873 -> 872.
    assert s.update(100) == 352
    assert s.update(333) == 872
    assert s.update(400) == 1024
    assert s.update(500) == 1024
    for t in (1, 7, 250, 399):
        assert s.value_at(t) == _root_value(t, 400, 128, 1024, 8, 1)


def test_random_ltd_layer_gathers_runs_and_scatters():
    model = _tiny_gpt(3)
    reference = copy.deepcopy(model)
    schedule = RandomLTDSchedule(6, 16, 100, 2, total_layers=3, ltd_layers=1, global_batch_size=4)
    ltd = RandomLTD(schedule, seed=5, batch_first=True, mask_name=None, dp_rank=1, dp_world_size=2)
    apply_random_ltd(list(model.blocks), [1], ltd)
    ltd.begin_forward(global_step=0, micro_step=3)
    idx = torch.randint(0, 256, (2, 16))
    out = model(idx)
    # Reference: the draw for the global batch of 4, rows 2-3 (rank 1 of 2), layer 0 of 1.
    scores = torch.rand(1, 4, 16, generator=shared_generator(5, 2, 3))
    rows = scores.argsort(-1)[..., :6].sort(-1).values[0, 2:4]
    x = reference.drop(reference.wte(idx) + reference.wpe(torch.arange(16)))
    x = reference.blocks[0](x)
    part = torch.stack([x[b, rows[b]] for b in range(2)])
    done = reference.blocks[1](part)
    merged = x.clone()
    for b in range(2):
        merged[b, rows[b]] = done[b]
    x = reference.blocks[2](merged)
    torch.testing.assert_close(out, reference.lm_head(reference.ln_f(x)), rtol=0, atol=1e-6)
    # Once the schedule keeps the whole sequence, the layer is the plain block.
    schedule.current = 16
    torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)


# -- config sections ----------------------------------------------------------------------------


def _curriculum(**schedule_config):
    return {
        **BASE,
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 8,
            "max_difficulty": 64,
            "schedule_type": "fixed_linear",
            "schedule_config": schedule_config,
        },
    }


def test_curriculum_config_total_step_alias_and_errors():
    cfg = load_config(_curriculum(total_step=100, difficulty_step=8))
    assert cfg.curriculum_learning.schedule_config.total == 100
    with pytest.raises(ConfigError, match="not both"):
        load_config(_curriculum(total_step=100, total_curriculum_step=100, difficulty_step=8))
    with pytest.raises(ConfigError, match=r"missing \['difficulty_step'\]"):
        load_config(_curriculum(total_curriculum_step=100))
    with pytest.raises(ConfigError, match=r"root_degree.*not read by schedule_type fixed_linear"):
        load_config(_curriculum(total_curriculum_step=10, difficulty_step=8, root_degree=2))
    # Disabled: placeholders in it stay harmless (only types are checked).
    load_config({**BASE, "curriculum_learning": {"enabled": False, "schedule_config": {}}})


def test_pld_config_defaults_and_ranges():
    cfg = load_config({**BASE, "progressive_layer_drop": {"enabled": True}})
    assert (cfg.progressive_layer_drop.theta, cfg.progressive_layer_drop.gamma) == (1.0, 0.001)
    with pytest.raises(ConfigError, match="theta"):
        load_config({**BASE, "progressive_layer_drop": {"enabled": True, "theta": 1.5}})
    assert not not_implemented(cfg)


def _random_ltd(**overrides):
    section = {
        "enabled": True,
        "total_layer_num": 4,
        "random_ltd_layer_num": 2,
        "random_ltd_layer_id": [1, 2],
        "random_ltd_schedule": {
            "min_value": 8,
            "max_value": 16,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 10, "seq_per_step": 4},
        },
        **overrides,
    }
    routing = {"enabled": True, "random_ltd": section}
    return {**BASE, "data_efficiency": {"enabled": True, "data_routing": routing}}


def test_random_ltd_config_checks():
    cfg = load_config(_random_ltd())
    assert cfg.data_efficiency.random_ltd().random_ltd_layer_id == [1, 2]
    with pytest.raises(ConfigError, match="must equal the number"):
        load_config(_random_ltd(random_ltd_layer_num=3))
    with pytest.raises(ConfigError, match="not a layer of total_layer_num 4"):
        load_config(_random_ltd(random_ltd_layer_id=[1, 4], random_ltd_layer_num=2))
    section = _random_ltd()
    routing = section["data_efficiency"]["data_routing"]["random_ltd"]
    routing["random_ltd_schedule"]["schedule_type"] = "fixed_root"
    with pytest.raises(ConfigError, match="schedule_type"):
        load_config(section)


def test_metric_indexed_sampling_is_refused_by_key():
    metric = {
        "index_to_sample_path": "/data/idx_sample",
        "index_to_metric_path": "/data/idx_metric",
        "difficulty_type": "percentile",
        "clustering_type": "schedule_based",
        "min_difficulty": 1,
        "max_difficulty": 100,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1, "root_degree": 2},
    }
    sampling = {
        "enabled": True,
        "curriculum_learning": {
            "enabled": True,
            "curriculum_metrics": {"vocabularyrarity": metric},
        },
    }
    cfg = load_config({**BASE, "data_efficiency": {"enabled": True, "data_sampling": sampling}})
    (problem,) = not_implemented(cfg)
    assert "curriculum_metrics.vocabularyrarity" in problem
    assert "data analyzer" in problem
    sampling["curriculum_learning"]["curriculum_metrics"] = {"seqlen_truncate": metric}
    cfg = load_config({**BASE, "data_efficiency": {"enabled": True, "data_sampling": sampling}})
    problems = "\n".join(not_implemented(cfg))
    assert "seqlen_truncate.index_to_sample_path" in problems
    assert "seqlen_truncate.index_to_metric_path" in problems
    seqlen = {k: v for k, v in metric.items() if "index" not in k and "type" not in k}
    seqlen["schedule_type"] = "fixed_root"
    sampling["curriculum_learning"]["curriculum_metrics"] = {"seqlen_truncate": seqlen}
    cfg = load_config({**BASE, "data_efficiency": {"enabled": True, "data_sampling": sampling}})
    assert not_implemented(cfg) == []
    assert cfg.data_efficiency.seqlen_curriculum()[0] == "seqlen_truncate"


def test_config_placeholders_are_all_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 4,\n "curriculum_learning": {"enabled": true,\n'
        ' "min_difficulty": CL_MIN,\n "max_difficulty": CL_MAX}}'
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert "'CL_MIN'" in str(info.value)
    assert "'CL_MAX' (line 4)" in str(info.value)


def test_random_ltd_on_llama_carries_rotary_positions_with_the_tokens():
    torch.manual_seed(0)
    model = _hf_models()["llama"]
    _, stack = find_block_stack(model, [], "random_ltd")
    schedule = RandomLTDSchedule(6, 12, 100, 2, total_layers=4, ltd_layers=2, global_batch_size=2)
    ltd = RandomLTD(schedule, seed=1, batch_first=True, mask_name="attention_mask")
    apply_random_ltd(list(stack), [1, 2], ltd)
    received = {}

    def record(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        received.update(hidden=hidden.shape, cos=kwargs["position_embeddings"][0])

    stack[2].register_forward_pre_hook(record, with_kwargs=True)
    full = {}
    stack[0].register_forward_pre_hook(
        lambda _m, a, k: full.update(cos=k["position_embeddings"][0]), with_kwargs=True
    )
    model.train()
    ltd.begin_forward(global_step=0, micro_step=0)
    ids = torch.randint(0, 64, (2, 12))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert received["hidden"] == (2, 6, 16)
    rows = ltd.indices(1, 2, 12, torch.device("cpu"))  # layer 2 is the second LTD layer
    expected = full["cos"].expand(2, -1, -1).gather(1, rows[..., None].expand(-1, -1, 8))
    torch.testing.assert_close(received["cos"], expected)
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for p in stack[2].parameters())


class _SeqFirstBlock(nn.Module):
    """A Megatron-style block on (seq, batch, hidden) with a (batch, 1, S, S) mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden, attention_mask=None):
        mixed = torch.einsum("bqk,kbh->qbh", attention_mask[:, 0], hidden)
        return hidden + self.proj(mixed)


def test_random_ltd_seq_batch_dim_gathers_hidden_and_mask():
    torch.manual_seed(0)
    block = _SeqFirstBlock()
    reference = copy.deepcopy(block)
    schedule = RandomLTDSchedule(3, 6, 100, 1, total_layers=1, ltd_layers=1, global_batch_size=2)
    ltd = RandomLTD(schedule, seed=2, batch_first=False, mask_name="attention_mask")
    apply_random_ltd([block], [0], ltd)
    ltd.begin_forward(global_step=0, micro_step=0)
    hidden = torch.randn(6, 2, 4)
    mask = torch.rand(2, 1, 6, 6)
    out = block(hidden, attention_mask=mask)
    rows = ltd.indices(0, 2, 6, torch.device("cpu"))
    expected = hidden.clone()
    for b in range(2):
        r = rows[b]
        part = reference(hidden[r, b : b + 1], attention_mask=mask[b : b + 1][:, :, r][:, :, :, r])
        expected[r, b] = part[:, 0]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    unchanged = [i for i in range(6) if i not in rows[0].tolist()]
    assert torch.equal(out[unchanged, 0], hidden[unchanged, 0])  # dropped tokens pass through

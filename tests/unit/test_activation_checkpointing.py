"""zerotrain.checkpointing in one process: exact gradients with dropout, every kind of
argument, nesting, the contiguous buffer, apply/remove, and measured activation memory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain import checkpointing
from zerotrain.examples.gpt import GPT, Block, GPTConfig
from zerotrain.utils.memory import PeakRSSMeter

CFG = GPTConfig(block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)


@pytest.fixture(autouse=True)
def _defaults():
    checkpointing.reset()
    yield
    checkpointing.reset()


def _batch(cfg: GPTConfig = CFG, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (batch, cfg.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    torch.manual_seed(11)
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "rng": torch.rand(3)}


def _assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in a["grads"].items():
        assert torch.equal(grad, b["grads"][name]), name
    assert torch.equal(a["rng"], b["rng"])


def test_apply_gives_bitwise_identical_gradients_with_dropout():
    torch.manual_seed(0)
    model = GPT(CFG)
    batch = _batch()
    plain = _step(model, batch)
    names = checkpointing.apply(model)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    checkpointed = _step(model, batch)
    _assert_same(plain, checkpointed)
    assert checkpointing.stats().calls == checkpointing.stats().recomputes == 3
    # Names, state-dict keys and classes as seen by user code are unchanged.
    assert isinstance(model.blocks[0], Block)
    assert type(model.blocks[0]).__name__ == "Block"
    assert list(model.state_dict()) == list(GPT(CFG).state_dict())
    assert checkpointing.remove(model) == 3
    assert type(model.blocks[0]) is Block
    _assert_same(plain, _step(model, batch))


def test_arguments_of_every_kind_and_keywords_reach_the_function():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    mask = torch.rand(4, 8) > 0.3  # a tensor that needs no gradient
    extra = [torch.randn(4, 8, requires_grad=True), None]

    # "debug" and "use_reentrant" are torch.utils.checkpoint's own keywords: they must reach
    # fn untouched.
    def fn(h, mask, *, scale, extra, debug, use_reentrant):
        out = F.dropout(lin(h), 0.5) * scale + extra[0]
        return out.masked_fill(mask, 0.0) * (2.0 if debug else 1.0), use_reentrant

    def run(wrapped: bool) -> dict:
        torch.manual_seed(3)
        for t in (x, extra[0], *lin.parameters()):
            t.grad = None
        call = (
            (lambda f, *a, **k: checkpointing.checkpoint(f, *a, **k))
            if wrapped
            else (lambda f, *a, **k: f(*a, **k))
        )
        out, passed = call(fn, x, mask, scale=0.5, extra=extra, debug=True, use_reentrant="kept")
        assert passed == "kept"
        out.square().sum().backward()
        return {"x": x.grad.clone(), "e": extra[0].grad.clone(), "w": lin.weight.grad.clone()}

    plain, checkpointed = run(False), run(True)
    for key in plain:
        assert torch.equal(plain[key], checkpointed[key]), key


def test_parameters_get_gradients_when_no_input_needs_one():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # requires_grad=False, e.g. the output of a frozen embedding
    checkpointing.checkpoint(lin, x).sum().backward()
    expected = x.sum(0, keepdim=True).expand(4, 4)
    torch.testing.assert_close(lin.weight.grad, expected, rtol=0, atol=0)


def test_nested_checkpoints_give_identical_gradients():
    torch.manual_seed(0)
    model = GPT(CFG)
    batch = _batch()
    plain = _step(model, batch)

    class Nested(Block):
        def forward(self, x):
            x = x + checkpointing.checkpoint(lambda h: self.attn(self.ln1(h)), x)
            return x + self.mlp(self.ln2(x))

    for block in model.blocks:
        block.__class__ = Nested
    checkpointing.apply(model, block_types=[Nested])
    _assert_same(plain, _step(model, batch))


def test_without_gradients_the_function_just_runs():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = checkpointing.checkpoint(lin, x)
    assert torch.equal(out, lin(x).detach())
    assert checkpointing.stats().calls == 0


def _arena() -> checkpointing.saved_inputs.ContiguousArena:
    keeper = checkpointing.default_context().keeper()
    return keeper._arenas[(torch.device("cpu"), False)]


def test_contiguous_buffer_holds_the_inputs_from_the_second_step_and_grows_on_demand():
    torch.manual_seed(0)
    model = GPT(CFG)
    small, large = _batch(batch=2), _batch(batch=3)
    plain = _step(model, small)
    checkpointing.apply(model)
    checkpointing.configure(contiguous_memory_optimization=True)
    input_bytes = 2 * CFG.block_size * CFG.n_embd * 4  # one block's input, aligned already
    _assert_same(plain, _step(model, small))  # sizes the buffer
    arena = _arena()
    assert arena.buffer is None  # the first step learns the size...
    _assert_same(plain, _step(model, small))
    assert arena.capacity == 3 * input_bytes  # ...the second uses it
    assert arena.cursor == 3 * input_bytes
    assert not arena._overflow
    first_buffer = arena.buffer
    _step(model, small)
    assert arena.buffer is first_buffer  # reused, not reallocated
    _step(model, large)  # needs more: the overflow is allocated on its own...
    assert arena._overflow
    _step(model, large)  # ...and the buffer regrows once free
    assert arena.capacity == 3 * input_bytes * 3 // 2
    assert not arena._overflow


def test_number_checkpoints_sizes_the_buffer_before_the_first_step():
    torch.manual_seed(0)
    model = GPT(CFG)
    plain = _step(model, _batch())
    checkpointing.apply(model)
    checkpointing.configure(contiguous_memory_optimization=True, number_checkpoints=3)
    _assert_same(plain, _step(model, _batch()))
    arena = _arena()
    assert arena.buffer is not None
    assert not arena._overflow


def test_placed_copies_keep_the_strides_of_their_originals():
    arena = checkpointing.saved_inputs.ContiguousArena(torch.device("cpu"), False, 4096)
    transposed = torch.randn(8, 6).t()
    sliced = torch.randn(8, 6)[:, ::2]
    assert arena.place(transposed).stride() == transposed.stride()
    assert arena.place(sliced).is_contiguous()  # not dense: copied contiguous


def test_profile_times_forward_and_recomputation():
    torch.manual_seed(0)
    model = GPT(CFG)
    checkpointing.apply(model)
    checkpointing.configure(profile=True, synchronize_checkpoint_boundary=True)
    _step(model, _batch())
    stats = checkpointing.stats()
    assert stats.forward_seconds > 0
    assert stats.recompute_seconds > 0
    assert "3 forward(s)" in stats.summary()
    assert "3 recomputation(s)" in stats.summary()
    checkpointing.reset_stats()
    assert checkpointing.stats().calls == 0


def test_apply_refuses_what_it_cannot_do():
    model = GPT(CFG)
    with pytest.raises(
        ValueError, match=r"match no module of GPT; its module classes are: .*Block"
    ):
        checkpointing.apply(model, block_types=["DecoderLayer"])
    with pytest.raises(ValueError, match="no repeated blocks"):
        checkpointing.apply(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match='"auto" or a list'):
        checkpointing.apply(model, block_types="Block")
    model.is_activation_checkpointing = True
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        checkpointing.apply(model)


def test_apply_twice_wraps_once_and_only_the_outermost_match():
    model = GPT(CFG)
    checkpointing.apply(model, block_types=[Block, "MLP"])  # MLP lies inside Block
    checkpointing.apply(model, block_types=["Block"])
    assert all(checkpointing.is_checkpointed(b) for b in model.blocks)
    assert not any(checkpointing.is_checkpointed(b.mlp) for b in model.blocks)
    assert checkpointing.remove(model) == CFG.n_layer


def test_configure_names_the_allowed_keys():
    with pytest.raises(TypeError, match=r"unknown option\(s\) cpu_offload; allowed: .*"):
        checkpointing.configure(cpu_offload=True)
    policy = checkpointing.configure(cpu_checkpointing=True, number_checkpoints=4)
    assert policy.cpu_checkpointing
    assert policy.number_checkpoints == 4
    assert checkpointing.current() == policy


def test_hugging_face_key_value_cache_is_switched_off():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.config.use_cache
    assert checkpointing.apply(model) == ["transformer.h.0", "transformer.h.1"]
    assert not model.config.use_cache
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert checkpointing.stats().recomputes == 2


_MEASURE = r"""
import json, sys, torch
from zerotrain import checkpointing
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.utils.memory import PeakRSSMeter
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=256, n_layer=6, n_head=4, n_embd=128, dropout=0.1))
if sys.argv[1] == "on":
    checkpointing.apply(model)
x = torch.randint(0, 256, (4, 256))
for _ in range(2):  # the second step: gradients exist already, as in training
    model.zero_grad(set_to_none=False)
    with PeakRSSMeter() as meter:
        model(x, x).backward()
print(json.dumps(meter.increase_bytes))
"""


def _peak_activation_bytes(mode: str) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_checkpointing_every_block_cuts_measured_peak_memory_of_a_step():
    try:
        with PeakRSSMeter():
            pass
    except OSError as err:
        pytest.skip(f"peak RSS cannot be reset here: {err}")
    plain = _peak_activation_bytes("off")
    checkpointed = _peak_activation_bytes("on")
    # Measured: about 131 MiB without, 27 MiB with (one block's activations at a time).
    assert checkpointed < 0.4 * plain, (plain, checkpointed)


def test_each_context_keeps_its_own_settings_and_counters():
    # Two engines in one process (a GAN's generator and discriminator) each activate their
    # own context around forward and backward; checkpoint() outside both uses the default.
    torch.manual_seed(0)
    model = GPT(CFG)
    checkpointing.apply(model)
    profiled = checkpointing.CheckpointingContext(
        dataclasses.replace(checkpointing.current(), profile=True)
    )
    plain = checkpointing.CheckpointingContext()
    with profiled.active():
        _step(model, _batch())
    with plain.active():
        _step(model, _batch())
        assert checkpointing.current() is plain.policy
    assert profiled.stats.calls == plain.stats.calls == 3
    assert profiled.stats.forward_seconds > 0
    assert plain.stats.forward_seconds == 0
    assert checkpointing.stats().calls == 0  # the default context saw none of it
    assert checkpointing.current() is checkpointing.default_context().policy

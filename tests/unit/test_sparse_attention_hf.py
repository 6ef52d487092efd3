"""Sparse attention in ``transformers`` models (zerotrain.sparse_attention.hf): tiny random-init
BERT, RoBERTa, GPT-2 and grouped-query Llama built from configs. A dense layout reproduces the
model's own attention (outputs and parameter gradients, fp32, 1e-5), padding included; a sparse
layout reproduces eager attention given the layout as an explicit mask; mismatches are refused
with errors that say what to change."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from zerotrain.sparse_attention import (
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    hf,
)

transformers = pytest.importorskip("transformers")

HEADS = 4
BLOCK = 16
MAX_LEN = 128
VOCAB = 64
TOL = {"rtol": 1e-5, "atol": 1e-5}
# Larger than the default 0.02, so that attention is far from uniform and which keys a query
# sees changes the output visibly.
INIT = 0.2


def _bert(**overrides: Any) -> nn.Module:
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "intermediate_size": 64,
        "max_position_embeddings": MAX_LEN,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": INIT,
    }
    kwargs.update(overrides)
    return transformers.BertForMaskedLM(transformers.BertConfig(**kwargs))


def _roberta() -> nn.Module:
    # Positions start after padding_idx (1): 130 table entries cover 128 tokens.
    config = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=INIT,
    )
    return transformers.RobertaModel(config)


def _gpt2() -> nn.Module:
    # scale_attn_by_inverse_layer_idx: layer 1 passes scaling != head_dim ** -0.5.
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=HEADS,
        n_positions=MAX_LEN,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        scale_attn_by_inverse_layer_idx=True,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=INIT,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,  # grouped-query attention: K/V heads repeated
        max_position_embeddings=MAX_LEN,
        initializer_range=INIT,
    )
    return transformers.LlamaForCausalLM(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "bert": (_bert, False),
    "roberta": (_roberta, False),
    "gpt2": (_gpt2, True),
    "llama": (_llama, True),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def _batch(length: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Two sequences; the second is right-padded after ``valid`` tokens (ids avoid RoBERTa's
    # padding id 1, which would move its positions).
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, valid:] = 0
    return ids, mask


def _run(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Output (logits or hidden states) and the gradients of a fixed projection of it.
    model.zero_grad(set_to_none=True)
    result = model(input_ids=ids, attention_mask=mask, use_cache=False)
    out = result.logits if hasattr(result, "logits") else result.last_hidden_state
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weights).sum().div(out.shape[0] * out.shape[1]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_same(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> None:
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _explicit_mask(
    layout_config: SparsityConfig, length: int, causal: bool, padding: torch.Tensor
) -> torch.Tensor:
    # The layout (built for MAX_LEN, top-left corner), causality and padding as one additive
    # (B, 1, L, L) mask: what eager attention needs to compute the sparse attention densely.
    layout = layout_config.make_layout(MAX_LEN)[0].bool()
    keep = layout.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:length, :length]
    if causal:
        keep = keep & torch.ones(length, length, dtype=torch.bool).tril()
    keep = keep[None, None] & padding.bool()[:, None, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("name", list(MODELS))
def test_dense_layout_matches_the_models_attention_with_padding(name):
    reference = _build(name)
    assert reference.config._attn_implementation == "sdpa"
    swapped = hf.replace_model_self_attention_with_sparse_self_attention(
        copy.deepcopy(reference), MAX_LEN, DenseSparsityConfig(HEADS, block=BLOCK)
    )
    assert swapped.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    sparse = hf.sparse_attention_of(swapped)
    assert sparse is not None
    assert sparse.causal == MODELS[name][1]
    assert sparse.max_seq_length == MAX_LEN
    if name == "gpt2":  # its second layer's scaling is not head_dim ** -0.5: pre-scaled
        layer = swapped.transformer.h[1].attn
        assert not math.isclose(layer.scaling, layer.head_dim**-0.5)
    ids, mask = _batch(72, valid=45)  # 72: not a multiple of the block
    _assert_same(_run(swapped, ids, mask), _run(reference, ids, mask))
    ids, full = _batch(64, valid=64)  # no padding: the model passes no mask at all
    _assert_same(_run(swapped, ids, full), _run(reference, ids, full))


def test_packed_sequences_mask_is_applied():
    # Packed position ids make Llama build a block-diagonal causal bool mask: not padding, so
    # it reaches the kernel as a dense mask.
    reference = _build("llama")
    swapped = hf.sparse_attention_for_hf(copy.deepcopy(reference), DenseSparsityConfig(HEADS))
    ids, _ = _batch(40, valid=40)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, -1)
    outs = [
        m(input_ids=ids, position_ids=positions, use_cache=False).logits
        for m in (reference, swapped)
    ]
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    plain = reference(input_ids=ids, use_cache=False).logits
    assert (plain - outs[0]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("bert", "fixed"),
        ("roberta", "fixed"),
        ("gpt2", "fixed"),
        ("llama", "fixed"),
        ("bert", "bslongformer"),
        ("llama", "bslongformer"),
    ],
)
def test_sparse_layout_matches_eager_with_the_layout_as_a_mask(name, layout):
    causal = MODELS[name][1]
    direction = "unidirectional" if causal else "bidirectional"
    section = {"mode": layout, "block": BLOCK, "attention": direction, "kernel": "blocked"}
    if layout == "fixed":
        section.update(num_local_blocks=2, num_global_blocks=1)
    reference = _build(name)
    swapped = hf.sparse_attention_for_hf(copy.deepcopy(reference), section)
    sparse = hf.sparse_attention_of(swapped)
    assert sparse is not None
    assert sparse.kernel == "blocked"
    layout_config = sparse.sparsity_config
    assert isinstance(layout_config, (FixedSparsityConfig, BSLongformerSparsityConfig))
    assert layout_config.num_heads == HEADS
    assert layout_config.attention == direction
    eager = copy.deepcopy(reference)
    eager.set_attn_implementation("eager")

    length = 75  # 5 blocks, the last one partial
    ids, padding = _batch(length, valid=58)
    blocks = layout_config.make_layout(MAX_LEN)[0, :5, :5].bool()
    visible = torch.ones(5, 5, dtype=torch.bool)
    visible = visible.tril() if causal else visible
    assert not blocks[visible].all()  # the layout leaves out blocks the model would attend
    explicit = _explicit_mask(layout_config, length, causal, padding)
    want = _run(eager, ids, explicit)
    _assert_same(_run(swapped, ids, padding), want)
    # A 4-D additive mask given to the swapped model is honoured too (here: the same blocks).
    _assert_same(_run(swapped, ids, explicit), want)
    dense = _run(reference, ids, padding)[0]
    assert (dense - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("name", "attention", "message"),
    [
        (
            "bert",
            "unidirectional",
            "BertForMaskedLM is a bidirectional encoder but the sparsity config has "
            "attention='unidirectional'; build it with attention='bidirectional'",
        ),
        (
            "llama",
            "bidirectional",
            "LlamaForCausalLM is a causal decoder but the sparsity config has "
            "attention='bidirectional'; build it with attention='unidirectional'",
        ),
    ],
)
def test_layout_direction_must_match_the_model(name, attention, message):
    layout = FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2, attention=attention)
    model = _build(name)
    with pytest.raises(ValueError, match=message):
        hf.sparse_attention_for_hf(model, layout)
    assert model.config._attn_implementation == "sdpa"  # nothing changed


def test_attention_dropout_is_refused_in_training_only(caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        model = hf.sparse_attention_for_hf(
            _bert(attention_probs_dropout_prob=0.1), DenseSparsityConfig(HEADS)
        )
    assert "attention_probs_dropout_prob=0.1 is configured" in caplog.text
    ids, mask = _batch(32, valid=32)
    model.train()
    with pytest.raises(ValueError, match=r"attention dropout 0\.1 but SparseSelfAttention has no"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()
    model(input_ids=ids, attention_mask=mask)


def test_unsupported_models_are_named():
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=HEADS)
    )
    cross = _bert(is_decoder=True, add_cross_attention=True)
    cases = [
        (bloom, r"BloomForCausalLM: .*does not route its attention through"),
        (nn.Linear(4, 4), "Linear: it is not a transformers PreTrainedModel"),
        (cross, "BertForMaskedLM: it has cross-attention layers"),
    ]
    for model, reason in cases:
        assert not hf.is_supported(model)
        with pytest.raises(ValueError, match=f"cannot swap sparse attention into {reason}") as err:
            hf.sparse_attention_for_hf(model, DenseSparsityConfig(HEADS))
        assert "Supported: transformers models whose attention layers go through" in str(err.value)
    assert hf.is_supported(_build("bert"))


def test_heads_and_length_limits():
    with pytest.raises(
        ValueError, match="num_heads=8 but BertForMaskedLM has num_attention_heads=4"
    ):
        hf.sparse_attention_for_hf(_build("bert"), DenseSparsityConfig(8))
    # Position embeddings are not extended: a longer max_position than the table is refused.
    bert_limit = r"max_seq_length=129 is more than the 128 positions of BertForMaskedLM"
    with pytest.raises(ValueError, match=bert_limit):
        hf.replace_model_self_attention_with_sparse_self_attention(
            _build("bert"), MAX_LEN + 1, DenseSparsityConfig(HEADS)
        )
    roberta = _build("roberta")
    with pytest.raises(ValueError, match=r"more than the 128 positions.*=130\)"):
        hf.replace_model_self_attention_with_sparse_self_attention(
            roberta, MAX_LEN + 1, DenseSparsityConfig(HEADS)
        )
    hf.replace_model_self_attention_with_sparse_self_attention(
        roberta, MAX_LEN, DenseSparsityConfig(HEADS)
    )
    sparse = hf.sparse_attention_of(roberta)
    assert sparse is not None
    assert sparse.max_seq_length == MAX_LEN
    assert roberta.config.max_position_embeddings == MAX_LEN + 2  # left as it was
    # Rotary positions have no table: the default length is the config's.
    llama = hf.sparse_attention_for_hf(_build("llama"), DenseSparsityConfig(HEADS))
    sparse = hf.sparse_attention_of(llama)
    assert sparse is not None
    assert sparse.max_seq_length == MAX_LEN


def test_kv_cache_decoding_and_copies_after_the_swap_are_refused():
    model = hf.sparse_attention_for_hf(_build("llama"), DenseSparsityConfig(HEADS))
    ids, _ = _batch(12, valid=12)
    prefill = model(input_ids=ids[:, :10], use_cache=True)
    with pytest.raises(ValueError, match=r"1 queries but 11 keys.*pass use_cache=False"):
        model(input_ids=ids[:, 10:11], cache=prefill.cache)
    copied = copy.deepcopy(model)
    assert hf.sparse_attention_of(copied) is None
    with pytest.raises(ValueError, match="belongs to no model passed to"):
        copied(input_ids=ids, use_cache=False)

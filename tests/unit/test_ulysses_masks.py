"""What a transformers model's attention mask would carry under Ulysses is kept or refused
by name, never dropped (review 2026-11-28, T2)."""

from __future__ import annotations

import pytest
import torch

from zerotrain.comm.local import LocalCommunicator
from zerotrain.parallel.sequence.hf import _window_mask, wrap_transformers_attention


def _gemma2() -> torch.nn.Module:
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    return transformers.Gemma2ForCausalLM(cfg)


def test_a_soft_capped_attention_is_refused_by_name():
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50\.0"):
        wrap_transformers_attention(_gemma2(), LocalCommunicator(torch.device("cpu")))


def test_the_window_mask_is_transformers_sliding_window():
    mask = _window_mask(6, 3, torch.device("cpu"))[0, 0]
    for i in range(6):
        assert mask[i].nonzero().flatten().tolist() == list(range(max(0, i - 2), i + 1))

"""Block-sparse attention: DeepSpeed's layouts, and the kernel against dense attention with
the same mask applied explicitly (fp32, 1e-5) for every layout, block size and direction."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    blocked,
    pad_to_block_size,
    sparsity_config_from_dict,
    unpad_sequence_output,
)

# -- layouts, checked against patterns written out by hand ----------------------------------


def _rows(layout: torch.Tensor, head: int = 0) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in layout[head].tolist()]


def test_fixed_bidirectional_windows_and_last_block_global():
    layout = FixedSparsityConfig(1, block=1, num_local_blocks=2).make_layout(6)
    # Windows {0,1} {2,3} {4,5}; the last block of each window is global for every row.
    assert _rows(layout) == [
        "xx.x.x",
        "xx.x.x",
        ".xxx.x",
        ".xxx.x",
        ".x.xxx",
        ".x.xxx",
    ]


def test_fixed_unidirectional_short_last_window_and_horizontal_refused():
    layout = FixedSparsityConfig(
        1, block=1, num_local_blocks=3, attention="unidirectional"
    ).make_layout(7)
    # Windows {0,1,2} {3,4,5} {6}; globals 2, 5 and (short window) 6, from their own row down.
    assert _rows(layout) == [
        "x......",
        "xx.....",
        "xxx....",
        "..xx...",
        "..xxx..",
        "..xxxx.",
        "..x..xx",
    ]
    with pytest.raises(ValueError, match="needs attention='bidirectional'"):
        FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True)


def test_fixed_global_pattern_differs_per_head():
    layout = FixedSparsityConfig(
        2,
        block=1,
        different_layout_per_head=True,
        num_local_blocks=2,
        num_different_global_patterns=2,
    ).make_layout(4)
    assert _rows(layout, 0) == ["xx.x", "xx.x", ".xxx", ".xxx"]
    assert _rows(layout, 1) == ["xxx.", "xxx.", "x.xx", "x.xx"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_local_blocks": 4, "num_global_blocks": 3}, "must be divisible by"),
        ({"num_different_global_patterns": 2}, "needs different_layout_per_head=true"),
        (
            {"num_different_global_patterns": 5, "different_layout_per_head": True},
            "larger than num_local_blocks / num_global_blocks = 4 / 1 = 4",
        ),
        ({"attention": "causal"}, "allowed values are 'unidirectional', 'bidirectional'"),
        ({"block": 0}, "block=0: must be an integer >= 1"),
    ],
)
def test_fixed_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FixedSparsityConfig(4, **kwargs)


def test_bslongformer_window_and_global_ranges():
    layout = BSLongformerSparsityConfig(
        1,
        block=1,
        num_sliding_window_blocks=3,
        global_block_indices=[0, 4],
        global_block_end_indices=[1, 6],
    ).make_layout(7)
    assert _rows(layout) == [
        "xxxxxxx",
        "xxx.xx.",
        "xxxxxx.",
        "x.xxxx.",
        "xxxxxxx",
        "xxxxxxx",
        "x...xxx",
    ]
    causal = BSLongformerSparsityConfig(1, block=1, attention="unidirectional").make_layout(4)
    assert _rows(causal) == ["x...", "xx..", "xxx.", "x.xx"]
    with pytest.raises(ValueError, match="must have the same length"):
        BSLongformerSparsityConfig(1, global_block_indices=[0, 2], global_block_end_indices=[1])
    with pytest.raises(ValueError, match="start index 3 must be smaller than its end index 3"):
        BSLongformerSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3])


def test_local_sliding_window_directions():
    uni = LocalSlidingWindowSparsityConfig(1, block=1, num_sliding_window_blocks=3)
    assert _rows(uni.make_layout(4)) == ["x...", "xx..", ".xx.", "..xx"]
    bi = LocalSlidingWindowSparsityConfig(1, block=1, attention="bidirectional")
    assert _rows(bi.make_layout(4)) == ["xx..", "xxx.", ".xxx", "..xx"]
    with pytest.raises(ValueError, match="num_sliding_window_blocks=5 is more than the 4"):
        LocalSlidingWindowSparsityConfig(1, block=1, num_sliding_window_blocks=5).make_layout(4)


def test_variable_windows_globals_and_seeded_random_blocks():
    layout = VariableSparsityConfig(
        1,
        block=1,
        local_window_blocks=[1, 2],
        global_block_indices=[3],
        horizontal_global_attention=True,
    ).make_layout(7)
    # Windows {0} {1,2} then size 2 repeats: {3,4} {5,6}; block 3 global both ways.
    assert _rows(layout) == [
        "x..x...",
        ".xxx...",
        ".xxx...",
        "xxxxxxx",
        "...xx..",
        "...x.xx",
        "...x.xx",
    ]
    one = VariableSparsityConfig(4, block=1, num_random_blocks=2, different_layout_per_head=True)
    again = VariableSparsityConfig(4, block=1, num_random_blocks=2, different_layout_per_head=True)
    other = VariableSparsityConfig(
        4, block=1, num_random_blocks=2, different_layout_per_head=True, seed=1
    )
    assert torch.equal(one.make_layout(32), again.make_layout(32))
    assert not torch.equal(one.make_layout(32), other.make_layout(32))
    assert not torch.equal(one.make_layout(32)[0], one.make_layout(32)[1])  # per-head draws
    with pytest.raises(ValueError, match="num_random_blocks=9 is more than the 8 blocks"):
        VariableSparsityConfig(1, block=1, num_random_blocks=9).make_layout(8)


def test_bigbird_counts_and_causal_random_blocks():
    cfg = BigBirdSparsityConfig(1, block=1, num_random_blocks=2, num_global_blocks=1)
    layout = cfg.make_layout(16)
    assert layout[0, 0].all()
    assert layout[0, :, 0].all()
    for row in range(1, 15):
        window = layout[0, row, row - 1 : row + 2].sum()
        assert window == 3
        assert 3 <= layout[0, row, 1:].sum() <= 5  # window + up to two random blocks
    causal = BigBirdSparsityConfig(1, block=1, num_random_blocks=2, attention="unidirectional")
    assert torch.equal(causal.make_layout(16), causal.make_layout(16).tril())


def test_dense_and_shared_layout_across_heads():
    assert DenseSparsityConfig(3, block=4).make_layout(16).all()
    shared = BigBirdSparsityConfig(3, block=1, num_random_blocks=2).make_layout(16)
    assert torch.equal(shared[0], shared[1])
    assert torch.equal(shared[0], shared[2])
    with pytest.raises(ValueError, match="must be a multiple of the block size 16"):
        DenseSparsityConfig(1).make_layout(40)


# -- the kernel against dense attention with the mask applied explicitly -------------------


def _element_mask(attn: SparseSelfAttention, length: int) -> torch.Tensor:
    block = attn.sparsity_config.block
    nb = -(-length // block)
    layout = attn.master_layout[:, :nb, :nb].bool()
    mask = layout.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :length, :length]
    if attn.causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def _dense(q, k, v, mask, bias=None):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # a row with no key -> 0
    return probs @ v


def _inputs(batch, heads, length, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, length, dim, generator=gen).requires_grad_(True) for _ in range(3)
    ]


def _assert_same(out, ref, inputs, tol=1e-5):
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def _layouts(heads: int, block: int, attention: str, per_head: bool):
    return [
        DenseSparsityConfig(heads, block, per_head),
        FixedSparsityConfig(
            heads,
            block,
            per_head,
            num_local_blocks=2,
            attention=attention,
            num_different_global_patterns=2 if per_head else 1,
        ),
        VariableSparsityConfig(
            heads,
            block,
            per_head,
            num_random_blocks=1,
            local_window_blocks=[1, 2],
            global_block_indices=[2],
            attention=attention,
        ),
        BigBirdSparsityConfig(heads, block, per_head, num_random_blocks=1, attention=attention),
        BSLongformerSparsityConfig(
            heads, block, per_head, global_block_indices=[1], attention=attention
        ),
        LocalSlidingWindowSparsityConfig(heads, block, attention=attention),
    ]


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("attention", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("per_head", [False, True])
def test_every_layout_matches_dense_with_the_same_mask(block, attention, per_head):
    heads = 2
    for length in (5 * block, 5 * block - 7):  # a multiple of the block, and one that is not
        for cfg in _layouts(heads, block, attention, per_head):
            attn = SparseSelfAttention(cfg, max_seq_length=6 * block)
            q, k, v = _inputs(2, heads, length, 8, seed=block + length)
            out = attn(q, k, v)
            # PyTorch's own attention with the layout applied as an explicit L x L mask.
            mask = _element_mask(attn, length)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            _assert_same(out, ref, (q, k, v))
            # The layout is really sparse (apart from dense) and really used.
            if not isinstance(cfg, DenseSparsityConfig):
                full = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal)
                assert not torch.allclose(out, full, atol=1e-3)


def test_masks_rpe_and_transposed_key_match_dense():
    heads, length, block = 2, 45, 16
    cfg = BSLongformerSparsityConfig(heads, block, num_sliding_window_blocks=1)
    gen = torch.Generator().manual_seed(5)
    for kp_mode, am_mode in (("add", "mul"), ("mul", "add")):
        attn = SparseSelfAttention(cfg, kp_mode, am_mode, max_seq_length=64)
        q, k, v = _inputs(2, heads, length, 8, seed=9)
        rpe = torch.randn(heads, length, length, generator=gen).requires_grad_(True)
        keep_keys = torch.ones(2, length)
        keep_keys[1, -6:] = 0
        keep_pairs = (torch.rand(length, length, generator=gen) > 0.2).float()
        kp = keep_keys if kp_mode == "mul" else (1 - keep_keys) * -10000.0
        am = keep_pairs if am_mode == "mul" else (1 - keep_pairs) * -10000.0
        out = attn(
            q, k.transpose(-1, -2), v, rpe=rpe, key_padding_mask=kp[:, None, None, :], attn_mask=am
        )
        bias = rpe + (1 - keep_keys)[:, None, None, :] * -1e30 + (1 - keep_pairs) * -1e30
        ref = _dense(q, k, v, _element_mask(attn, length), bias.clamp_min(-1e30))
        _assert_same(out, ref, (q, k, v, rpe))


def test_a_query_with_no_key_gets_zero_output_and_gradient():
    cfg = DenseSparsityConfig(1, 16)
    attn = SparseSelfAttention(cfg, max_seq_length=32)
    q, k, v = _inputs(1, 1, 32, 4)
    mask = torch.ones(32, 32, dtype=torch.bool)
    mask[3] = False
    out = attn(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert out[0, 0, 3].abs().max() == 0
    out.sum().backward()
    assert q.grad is not None
    assert torch.isfinite(q.grad).all()
    assert q.grad[0, 0, 3].abs().max() == 0


def test_chunked_rows_match_one_chunk(monkeypatch):
    cfg = BigBirdSparsityConfig(2, 16, True, num_random_blocks=2, attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=256)
    q, k, v = _inputs(1, 2, 250, 8)
    whole = attn(q, k, v)
    monkeypatch.setattr(blocked, "SCORE_BUDGET", 1)  # one query block per chunk
    _assert_same(attn(q, k, v), whole, (q, k, v), tol=1e-6)


def test_half_precision_runs_softmax_in_float32():
    cfg = FixedSparsityConfig(2, 16, attention="unidirectional")
    attn = SparseSelfAttention(cfg, max_seq_length=64)
    q, k, v = (t.detach().bfloat16().requires_grad_(True) for t in _inputs(1, 2, 64, 8))
    out = attn(q, k, v)
    ref = _dense(q.float(), k.float(), v.float(), _element_mask(attn, 64))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_named():
    attn = SparseSelfAttention(FixedSparsityConfig(2, 16), max_seq_length=64)
    q, k, v = _inputs(1, 2, 32, 8)
    big = torch.zeros(1, 2, 80, 8)
    with pytest.raises(ValueError, match="longer than max_seq_length=64"):
        attn(big, big, big)
    three = torch.zeros(1, 3, 32, 8)
    with pytest.raises(ValueError, match="built for 2"):
        attn(three, three, three)
    with pytest.raises(ValueError, match="must have one shape"):
        attn(q, k[:, :, :16], v)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(3, 32, 32\)"):
        attn(q, k, v, attn_mask=torch.ones(3, 32, 32))
    with pytest.raises(ValueError, match="key_padding_mask_mode='max'"):
        SparseSelfAttention(FixedSparsityConfig(2), key_padding_mask_mode="max")
    with pytest.raises(ValueError, match="kernel='triton'"):
        SparseSelfAttention(FixedSparsityConfig(2), kernel="triton")


def test_layout_is_not_in_the_state_dict_but_a_deepspeed_one_is_checked():
    attn = SparseSelfAttention(FixedSparsityConfig(2, 16), max_seq_length=64)
    assert "master_layout" not in attn.state_dict()
    # Heads that share the layout keep one copy; DeepSpeed's (H, nb, nb) view is still there.
    assert attn.layout_heads.shape == (1, 4, 4)
    assert attn.master_layout.shape == (2, 4, 4)
    per_head = SparseSelfAttention(FixedSparsityConfig(2, 16, True), max_seq_length=64)
    assert per_head.layout_heads.shape == (2, 4, 4)
    attn.load_state_dict({"master_layout": attn.master_layout.clone()})
    wrong = torch.zeros_like(attn.master_layout)
    with pytest.raises(RuntimeError, match="master_layout in the checkpoint differs"):
        attn.load_state_dict({"master_layout": wrong})


def test_padding_helpers_and_zero_gradient_for_padding():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pad_len, ids_p, mask_p, types_p, pos_p, embeds = pad_to_block_size(
        4, ids, None, torch.zeros_like(ids), torch.arange(5)[None], None, pad_token_id=0
    )
    assert pad_len == 3
    assert ids_p.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert mask_p.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert types_p.shape == (1, 8)
    assert pos_p.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0]]
    assert embeds is None
    emb = torch.nn.Embedding(10, 8)
    x = emb(ids_p).view(1, 8, 2, 4).transpose(1, 2)  # (B, H, L, D)
    attn = SparseSelfAttention(DenseSparsityConfig(2, 4), "mul", max_seq_length=8)
    out = attn(x, x, x, key_padding_mask=mask_p, attn_mask=None)
    out = unpad_sequence_output(pad_len, out.transpose(1, 2))
    assert out.shape == (1, 5, 2, 4)
    out.sum().backward()
    assert emb.weight.grad is not None
    assert emb.weight.grad[0].abs().max() == 0
    with pytest.raises(ValueError, match="pass model_embeddings"):
        pad_to_block_size(4, None, None, None, None, torch.zeros(1, 5, 8), 0)


# -- the config section ----------------------------------------------------------------------


def test_section_defaults_are_deepspeeds():
    fixed = sparsity_config_from_dict({}, num_heads=4)
    assert fixed == FixedSparsityConfig(4, block=16, num_local_blocks=4, num_global_blocks=1)
    assert fixed.attention == "bidirectional"
    assert fixed.num_different_global_patterns == 1
    variable = sparsity_config_from_dict({"mode": "variable"}, 4)
    assert isinstance(variable, VariableSparsityConfig)
    assert (variable.num_random_blocks, variable.local_window_blocks) == (0, [4])
    assert (variable.global_block_indices, variable.global_block_end_indices) == ([0], None)
    bigbird = sparsity_config_from_dict({"mode": "bigbird"}, 4)
    assert (bigbird.num_random_blocks, bigbird.num_sliding_window_blocks) == (1, 3)
    local = sparsity_config_from_dict({"mode": "local", "block": 32}, 4)
    assert (local.attention, local.block) == ("unidirectional", 32)


def test_section_errors_and_unused_key_warning(caplog):
    with pytest.raises(ValueError, match="mode='sparse': allowed modes are 'dense', 'fixed'"):
        sparsity_config_from_dict({"mode": "sparse"}, 4)
    with pytest.raises(ValueError, match=r"unknown key.s. num_blocks; allowed keys are"):
        sparsity_config_from_dict({"num_blocks": 3}, 4)
    with caplog.at_level(logging.WARNING):
        sparsity_config_from_dict({"mode": "dense", "num_random_blocks": 2}, 4)
    assert "num_random_blocks has no effect in mode 'dense'" in caplog.text


def test_config_file_section_is_typed_when_loaded():
    # Keys and value types at load; combinations when initialize builds the layout (above).
    with pytest.raises(ConfigError, match=r"sparse_attention.blocks"):
        load_config({"sparse_attention": {"blocks": 16}})
    with pytest.raises(ConfigError, match=r"sparse_attention.attention"):
        load_config({"sparse_attention": {"attention": "causal"}})
    with pytest.raises(ConfigError, match=r"sparse_attention.mode"):
        load_config({"sparse_attention": {"mode": "sparse"}})
    cfg = load_config({"sparse_attention": {"mode": "bslongformer", "kernel": "blocked"}})
    assert cfg.sparse_attention is not None
    assert cfg.sparse_attention.kernel == "blocked"


# -- FlexAttention (compiled; forward only on CPU) ---------------------------------------------


@pytest.mark.slow
def test_flex_kernel_matches_blocked_in_inference_and_refuses_cpu_training():
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = BigBirdSparsityConfig(2, 16, True, num_random_blocks=1, attention="unidirectional")
    blocked_attn = SparseSelfAttention(cfg, "mul", max_seq_length=128, kernel="blocked")
    flex_attn = SparseSelfAttention(cfg, "mul", max_seq_length=128, kernel="flex")
    q, k, v = (t.detach() for t in _inputs(1, 2, 120, 16))
    keep = torch.ones(1, 120)
    keep[0, -9:] = 0
    pairs = torch.rand(120, 120, generator=torch.Generator().manual_seed(1)) > 0.1
    with torch.no_grad():
        want = blocked_attn(q, k, v, key_padding_mask=keep, attn_mask=pairs)
        got = flex_attn(q, k, v, key_padding_mask=keep, attn_mask=pairs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="'flex' cannot train on CPU"):
        flex_attn(q.requires_grad_(True), k, v)


def test_gpt_swap_reads_the_section_and_refuses_attention_dropout():
    from zerotrain.examples.gpt import GPT, GPTConfig
    from zerotrain.sparse_attention.swap import SparseCausalCore, sparse_attention_for_gpt

    section = {"mode": "local", "block": 16, "max_seq_length": 48, "kernel": "blocked"}
    model = sparse_attention_for_gpt(
        GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=16)), section
    )
    cores = [block.attn.core for block in model.blocks]
    assert all(isinstance(core, SparseCausalCore) for core in cores)
    attention = cores[0].attention
    assert attention is cores[1].attention  # one module, one layout, for every block
    assert (attention.max_seq_length, attention.kernel, attention.causal) == (48, "blocked", True)
    assert model(torch.zeros(1, 40, dtype=torch.long)).shape == (1, 40, 256)
    with pytest.raises(ValueError, match="longer than max_seq_length=48"):
        model(torch.zeros(1, 60, dtype=torch.long))
    dropout = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.1))
    with pytest.raises(ValueError, match="sparse attention has no attention dropout"):
        sparse_attention_for_gpt(dropout, section)

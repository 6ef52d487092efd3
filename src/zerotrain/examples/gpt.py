"""A small byte-level GPT: the model of the demo, the tests and the benchmarks.

Plain PyTorch in the style of nanoGPT: pre-norm blocks with causal self-attention, an MLP,
and an output head tied to the token embedding. ``GPT`` carries a tensor-parallel plan
(``_tp_plan``, the attribute ``transformers`` models carry) and is written so that the plan
applies: attention takes its head count from the projection's width, the fused ``[q; k; v]``
projection is packed, and the loss takes the vocabulary-parallel cross-entropy when the head
is split. Unsplit, it is plain PyTorch.
``gpt_pipeline_layers`` writes the same model as a layer list for ``zerotrain.pipe``'s
``PipelineModule``, DeepSpeed's pipeline-parallel style.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm.regions import gather_along
from zerotrain.parallel.tensor import (
    ColumnParallelLinear,
    tensor_parallel_rng,
    vocab_parallel_cross_entropy,
)
from zerotrain.pipe import LayerSpec, TiedLayerSpec


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``vocab_size`` 256 = bytes."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # Dropout on the attention probabilities (None: ``dropout``). Under tensor parallelism
    # it is drawn from each rank's own stream (its heads), the rest from the shared one.
    attn_dropout: float | None = None
    bias: bool = True
    tie_weights: bool = True


class CausalCore(nn.Module):
    """Causal scaled dot-product attention on ``[batch, heads, time, head_dim]`` tensors:
    the part Ulysses sequence parallelism runs on whole sequences (``Block._sp_plan``)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head  # of the whole layer (tensor parallelism checks it divides)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.core = CausalCore(cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The head count follows from the projection's width: under tensor parallelism the
        # packed qkv holds this rank's heads only. The sequence length too: with sequence
        # parallelism x is this rank's slice and qkv gathers the whole sequence; with Ulysses
        # it is this rank's slice, and the core sees the whole sequence for some heads.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        with tensor_parallel_rng(self):
            y = self.core(q, k, v)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward layer (4x expansion, GELU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block. ``_sp_plan`` names its attention core, which Ulysses
    sequence parallelism runs on whole sequences."""

    _sp_plan: ClassVar[dict[str, str]] = {"attn.core": "bhsd"}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes.

    ``forward(idx)`` returns logits of shape (batch, time, vocab); ``forward(idx, targets)``
    returns the mean cross-entropy loss, which is what ``engine(batch)`` is expected to give.
    ``position_ids`` place a slice of a longer sequence and ``num_items_in_batch`` replaces
    the mean's denominator (the loss is then ``sum / num_items_in_batch``): what
    ``zerotrain.parallel.sequence.shard_batch`` hands each rank under Ulysses.

    ``_tp_plan`` splits it Megatron's way: the token embedding and the (tied) head along the
    vocabulary, qkv and the MLP's first layer by output columns, the two output projections
    by input rows; the position embedding and LayerNorms stay whole. The ``sequence`` entries
    act only with Megatron sequence parallelism. Ulysses finds each block's ``_sp_plan``.
    """

    _tp_plan: ClassVar[dict[str, str]] = {
        "wte": "vocab",
        "drop": "sequence_scatter",
        "blocks.*.ln1": "sequence",
        "blocks.*.attn.qkv": "packed_colwise:3",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln2": "sequence",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "ln_f": "sequence",
        "lm_head": "colwise",
    }

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) to keep activations stable.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
    ) -> Any:
        _, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        if position_ids is None:
            pos = torch.arange(t, device=idx.device)
        elif int(position_ids.max()) >= self.cfg.block_size:
            raise ValueError(
                f"position {int(position_ids.max())} exceeds block_size {self.cfg.block_size}"
            )
        else:
            pos = position_ids
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        head = self.lm_head
        if isinstance(head, ColumnParallelLinear) and not head.gather_output:
            # The vocabulary is split: this rank holds its columns of the logits.
            if targets is None:
                return gather_along(logits, head.comm, -1)
            losses = vocab_parallel_cross_entropy(logits, targets, head.comm)
            return (
                losses.mean() if num_items_in_batch is None else losses.sum() / num_items_in_batch
            )
        if targets is None:
            return logits
        flat_logits, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        if num_items_in_batch is None:
            return F.cross_entropy(flat_logits, flat_targets)
        return F.cross_entropy(flat_logits, flat_targets, reduction="sum") / num_items_in_batch

    def num_parameters(self) -> int:
        """Distinct parameters (a tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())


class GPTEmbedding(nn.Module):
    """Token plus position embedding, then dropout: the first layer of the pipeline layer list.

    Initialised as ``GPT`` initialises ``wte`` / ``wpe``. The last layer reuses ``token``'s
    weight as the output head (``gpt_tied_head``).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.token = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.apply(GPT._init_weights)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x``: token ids, or ``(ids, position_ids)`` for a slice of a longer sequence
        (Ulysses: ``gpt_pipeline_micro_batch``)."""
        idx, positions = x if isinstance(x, tuple) else (x, None)
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        if positions is None:
            positions = torch.arange(t, device=idx.device)
        return self.drop(self.token(idx) + self.position(positions))


class GPTBlock(Block):
    """A ``Block`` initialised as ``GPT`` initialises its blocks (normal(0.02), residual
    projections scaled by ``1/sqrt(2 * n_layer)``), each block on its own so that a
    pipeline stage can build it without the others."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))


class GPTHead(nn.Module):
    """Untied output head (``tie_weights=False``), initialised as ``GPT.lm_head``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(GPT._init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def gpt_tied_head(embedding: GPTEmbedding, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(batch, time, vocab)`` through the token embedding's weight (the tied head)."""
    return F.linear(x, embedding.token.weight)


def gpt_pipeline_layers(cfg: GPTConfig) -> list[LayerSpec]:
    """``GPT(cfg)`` as a pipeline layer list: embedding, ``n_layer`` blocks, final norm, head.

    With ``tie_weights`` the first and last entries are ``TiedLayerSpec("embed", ...)``: each
    stage holding one builds a ``GPTEmbedding`` and the head reads its ``token.weight``. Each
    layer initialises itself as ``GPT`` does, so with ``seed_layers`` the values do not
    depend on the number of stages. Token ids go in, logits come out (``gpt_loss_fn``).
    """
    layers: list[LayerSpec] = [
        TiedLayerSpec("embed", GPTEmbedding, cfg, tied_weight_attr=["token.weight"])
        if cfg.tie_weights
        else LayerSpec(GPTEmbedding, cfg)
    ]
    layers += [LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layer)]
    layers.append(LayerSpec(nn.LayerNorm, cfg.n_embd, bias=cfg.bias))
    layers.append(
        TiedLayerSpec(
            "embed",
            GPTEmbedding,
            cfg,
            forward_fn=gpt_tied_head,
            tied_weight_attr=["token.weight"],
        )
        if cfg.tie_weights
        else LayerSpec(GPTHead, cfg)
    )
    return layers


def gpt_loss_fn(
    logits: torch.Tensor, targets: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (batch, time, vocab) against ``targets`` (batch,
    time), or ``sum / num_items_in_batch`` for ``(targets, num_items_in_batch)`` (a slice of a
    longer sequence under Ulysses: ``gpt_pipeline_micro_batch``)."""
    flat = logits.reshape(-1, logits.size(-1))
    if isinstance(targets, tuple):
        targets, count = targets
        return F.cross_entropy(flat, targets.reshape(-1), reduction="sum") / count
    return F.cross_entropy(flat, targets.reshape(-1))


def gpt_pipeline_micro_batch(sharded: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """``(inputs, labels)`` for ``gpt_pipeline_layers`` from ``engine.shard_sequence({"idx":
    x, "targets": y})``: the slice's ids with their positions, its targets with the
    sequence group's count (plain ``(ids, targets)`` when nothing was sharded)."""
    if "position_ids" not in sharded:
        return sharded["idx"], sharded["targets"]
    return (
        (sharded["idx"], sharded["position_ids"]),
        (sharded["targets"], sharded["num_items_in_batch"]),
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups: matrices with ``weight_decay``, biases/norms/embeddings without."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and "wpe" not in name else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@torch.no_grad()
def generate(
    model: GPT, prompt: bytes, max_new_bytes: int, temperature: float = 0.8, seed: int = 0
) -> bytes:
    """Continue ``prompt`` by sampling ``max_new_bytes`` bytes (deterministic for a seed)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(max_new_bytes):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1, :].float().cpu()
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return bytes(idx[0, len(prompt) :].tolist())

"""``SparseSelfAttention``: DeepSpeed's block-sparse attention module, on our kernels."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.sparse_attention.blocked import BlockTable, Extras, block_sparse_attention
from zerotrain.sparse_attention.flex import flex_available, flex_block_sparse_attention
from zerotrain.sparse_attention.sparsity_config import BUILT_IN_LAYOUTS, SparsityConfig

MASK_MODES = ("add", "mul")
KERNELS = ("auto", "blocked", "flex")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: allowed values are {', '.join(map(repr, allowed))}")


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    # "mul" masks keep where non-zero (DeepSpeed: 0 -> -inf, anything else -> 0).
    if mode == "mul" or mask.dtype == torch.bool:
        keep = mask if mask.dtype == torch.bool else mask != 0
        zeros = torch.zeros(keep.shape, dtype=torch.float32, device=mask.device)
        return zeros.masked_fill(~keep, float("-inf"))
    return mask.float()


def _dense_mask(mask: torch.Tensor, mode: str) -> torch.Tensor:
    # An L x L mask that only keeps or removes stays a bool keep-mask (a quarter of float32's
    # memory, and no float copy at all for a bool input); an additive one becomes float.
    if mode == "mul" or mask.dtype == torch.bool:
        return mask if mask.dtype == torch.bool else mask != 0
    return mask.float()


def _pad_square(t: torch.Tensor, extra: int, value: float | bool) -> torch.Tensor:
    if not extra:
        return t
    padded = t.new_full((*t.shape[:-2], t.shape[-2] + extra, t.shape[-1] + extra), value)
    padded[..., : t.shape[-2], : t.shape[-1]] = t
    return padded


def _as_4d(t: torch.Tensor, name: str, batch: int, heads: int, length: int) -> torch.Tensor:
    # (L, L), (h, L, L) or (b, h, L, L) with b in {1, B}, h in {1, H} -> 4-D.
    given = tuple(t.shape)
    while 2 <= t.dim() < 4:
        t = t.unsqueeze(0)
    shape_ok = t.dim() == 4 and t.shape[2:] == (length, length)
    if not shape_ok or t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads):
        raise ValueError(
            f"{name} has shape {given}; allowed: ({length}, {length}), "
            f"(1|{heads}, {length}, {length}) or (1|{batch}, 1|{heads}, {length}, {length})"
        )
    return t


def _build_layout(config: SparsityConfig, seq_len: int) -> torch.Tensor:
    # The built-in classes copy head 0 to every head unless different_layout_per_head: build
    # and keep that one head, (1, nb, nb) (1/H of the time and memory at long lengths).
    shared = not config.different_layout_per_head and config.num_heads > 1
    if not shared or type(config) not in BUILT_IN_LAYOUTS:
        return config.make_layout(seq_len).bool()
    one = copy.copy(config)
    one.num_heads = 1
    return one.make_layout(seq_len).bool()


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (DeepSpeed's ``SparseSelfAttention``), in fp32, bf16 or fp16.

    The layout comes from ``sparsity_config`` for ``max_seq_length`` tokens (rounded up to the
    block); shorter sequences use its top-left corner, as in DeepSpeed. Lengths that are not a
    multiple of the block are padded inside and the padding is masked; the output has the
    input's length.

    Args:
        sparsity_config: one of the layout classes (``FixedSparsityConfig``, ...).
        key_padding_mask_mode: ``"add"`` (the mask is added to the scores) or ``"mul"`` (zero
            entries are masked out).
        attn_mask_mode: the same choice for ``attn_mask``.
        max_seq_length: the longest sequence the module will see.
        causal: mask keys after each query inside the blocks too; default: whether the layout
            is ``"unidirectional"``.
        kernel: ``"blocked"`` (pure torch, trains everywhere), ``"flex"`` (compiled
            FlexAttention: CUDA, or CPU without gradients) or ``"auto"`` (flex on CUDA,
            blocked otherwise).

    Raises:
        ValueError: an unknown mode or kernel, or a ``max_seq_length`` below one block.
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig,
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
        *,
        causal: bool | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        _check_choice("key_padding_mask_mode", key_padding_mask_mode, MASK_MODES)
        _check_choice("attn_mask_mode", attn_mask_mode, MASK_MODES)
        _check_choice("kernel", kernel, KERNELS)
        if max_seq_length < 1:
            raise ValueError(f"max_seq_length={max_seq_length}: must be at least 1")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.causal = sparsity_config.attention == "unidirectional" if causal is None else causal
        self.kernel = kernel
        block = sparsity_config.block
        padded = math.ceil(max_seq_length / block) * block
        # Not persistent: the layout is a pure function of the config (random blocks are
        # seeded), so checkpoints do not carry it and every rank builds the same one.
        # Kept as bool (DeepSpeed: int64), and as one head when every head shares it: the
        # layout is quadratic in the block count.
        self.register_buffer(
            "layout_heads", _build_layout(sparsity_config, padded), persistent=False
        )
        self._tables: dict[tuple[int, str], BlockTable] = {}

    layout_heads: torch.Tensor

    @property
    def master_layout(self) -> torch.Tensor:
        """The ``(num_heads, nb, nb)`` bool layout for ``max_seq_length`` (DeepSpeed's name);
        a view of one head expanded when every head shares it."""
        return self.layout_heads.expand(self.sparsity_config.num_heads, -1, -1)

    def extra_repr(self) -> str:
        return (
            f"{self.sparsity_config!r}, causal={self.causal}, kernel={self.kernel!r}, "
            f"max_seq_length={self.max_seq_length}"
        )

    def block_table(self, padded_length: int, device: torch.device) -> BlockTable:
        """The block table for ``padded_length`` tokens (a multiple of the block), cached."""
        key = (padded_length, str(device))
        if key not in self._tables:
            nb = padded_length // self.sparsity_config.block
            heads = self.sparsity_config.num_heads
            layout = self.layout_heads[:, :nb, :nb].cpu().expand(heads, -1, -1)
            table = BlockTable.from_layout(layout, self.sparsity_config.block, self.causal)
            self._tables[key] = table.to(device)
        return self._tables[key]

    def density(self, seq_len: int) -> float:
        """Fraction of the attention matrix computed at ``seq_len`` (blocks, causal-trimmed)."""
        block = self.sparsity_config.block
        return self.block_table(math.ceil(seq_len / block) * block, torch.device("cpu")).density

    def _kernel_for(self, query: torch.Tensor) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "flex" if query.is_cuda and flex_available() else "blocked"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` to ``key`` / ``value`` over the layout's blocks.

        Args:
            query, value: ``(B, H, L, D)``.
            key: ``(B, H, L, D)``, or ``(B, H, D, L)`` already transposed (as DeepSpeed allows;
                as there, when ``D == L`` a key is taken as not transposed).
            rpe: added to the scores; ``(L, L)``, ``(H, L, L)`` or ``(B, H, L, L)`` (1 for a
                broadcast dimension); differentiated.
            key_padding_mask: ``(B, L)`` (or with singleton middle dimensions), per
                ``key_padding_mask_mode``.
            attn_mask: ``(L, L)`` or ``(1|B, 1|H, L, L)``, per ``attn_mask_mode``; bool
                masks keep where True in either mode.

        Returns:
            ``(B, H, L, D)`` in ``query``'s dtype.

        Raises:
            ValueError: shapes that do not match, a head count other than the layout's, or a
                sequence longer than ``max_seq_length``.
        """
        if query.dim() != 4:
            raise ValueError(
                f"query must be (batch, heads, seq, head_dim); got {tuple(query.shape)}"
            )
        batch, heads, length, dim = query.shape
        if key.shape != query.shape and key.shape[-1] == length:
            key = key.transpose(-1, -2)
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(
                f"SparseSelfAttention is self-attention: query, key and value must have one "
                f"shape; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if heads != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {heads} heads but the sparsity config was built for "
                f"{self.sparsity_config.num_heads}"
            )
        if length > self.max_seq_length:
            raise ValueError(
                f"sequence length {length} is longer than max_seq_length="
                f"{self.max_seq_length}; build SparseSelfAttention with a larger max_seq_length "
                "(the sparse_attention section's max_seq_length key when initialize built it)"
            )
        block = self.sparsity_config.block
        padded = math.ceil(length / block) * block
        extra = padded - length
        extras = self._extras(batch, heads, length, extra, rpe, key_padding_mask, attn_mask)
        q, k, v = (F.pad(t, (0, 0, 0, extra)) if extra else t for t in (query, key, value))
        table = self.block_table(padded, query.device)
        run = (
            flex_block_sparse_attention
            if self._kernel_for(query) == "flex"
            else block_sparse_attention
        )
        out = run(q, k, v, table, extras, scale=dim**-0.5, causal=self.causal, length=length)
        return out[:, :, :length] if extra else out

    def _extras(
        self,
        batch: int,
        heads: int,
        length: int,
        extra: int,
        rpe: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> Extras:
        key_bias = None
        if key_padding_mask is not None:
            kp = key_padding_mask.reshape(key_padding_mask.shape[0], -1)
            if kp.shape != (batch, length):
                raise ValueError(
                    f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; allowed: "
                    f"({batch}, {length}) (singleton middle dimensions are squeezed)"
                )
            key_bias = F.pad(_additive(kp, self.key_padding_mask_mode), (0, extra))
        dense_bias = None
        if attn_mask is not None:
            am = _dense_mask(
                _as_4d(attn_mask, "attn_mask", batch, heads, length), self.attn_mask_mode
            )
            # Padding positions are excluded by the kernel itself; any fill value does.
            dense_bias = _pad_square(am, extra, True if am.dtype == torch.bool else 0.0)
        rpe4 = None
        if rpe is not None:
            rpe4 = F.pad(_as_4d(rpe, "rpe", batch, heads, length), (0, extra, 0, extra))
        return Extras(key_bias=key_bias, dense_bias=dense_bias, rpe=rpe4)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # DeepSpeed saved the layout as a persistent buffer; accept it from such checkpoints
        # when it is the layout this config builds, and refuse a different one.
        saved = state_dict.pop(prefix + "master_layout", None)
        if saved is not None and not torch.equal(saved.cpu().bool(), self.master_layout.bool()):
            error_msgs = args[-1]
            error_msgs.append(
                f"{prefix}master_layout in the checkpoint differs from the layout "
                f"{self.sparsity_config!r} builds for max_seq_length={self.max_seq_length}"
            )
        super()._load_from_state_dict(state_dict, prefix, *args)

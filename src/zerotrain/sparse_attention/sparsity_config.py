"""Block-sparsity layouts of self-attention, with DeepSpeed's class names, arguments and checks.

A layout is an int8 tensor of shape ``(num_heads, num_blocks, num_blocks)``: entry
``[h, i, j] == 1`` means that in head ``h`` the queries of block ``i`` attend to the keys of
block ``j``. Each class builds one family of patterns (Sparse Transformer "fixed", BigBird,
Longformer, ...) exactly as DeepSpeed 0.19.5 and earlier built it, so a model trained with
DeepSpeed's sparse attention keeps its pattern.

Two deliberate differences, both documented in docs/sparse_attention.md:

* Random blocks come from a generator seeded by ``seed`` (default 0), not from Python's global
  ``random``: every rank builds the same layout without a broadcast, and a run is reproducible.
* ``attention="unidirectional"`` is also applied inside the diagonal blocks by
  :class:`~zerotrain.sparse_attention.SparseSelfAttention` (DeepSpeed only removed whole blocks
  above the diagonal and left the rest to the caller's ``attn_mask``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

ATTENTION_TYPES = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_TYPES:
        raise ValueError(
            f"sparse_attention.attention={attention!r}: allowed values are "
            f"{', '.join(map(repr, ATTENTION_TYPES))}"
        )


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"sparse_attention.{name}={value!r}: must be an integer >= {minimum}")


def _check_horizontal(attention: str, horizontal: bool) -> None:
    if attention != "bidirectional" and horizontal:
        raise ValueError(
            "sparse_attention.horizontal_global_attention=true needs "
            "attention='bidirectional' (a causal query block cannot attend to later blocks)"
        )


def _check_fits(name: str, count: int, num_blocks: int) -> None:
    if num_blocks < count:
        raise ValueError(
            f"sparse_attention.{name}={count} is more than the {num_blocks} blocks of a row "
            "at this sequence length"
        )


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if len(starts) == 0:
        raise ValueError("sparse_attention.global_block_indices=[]: give at least one index")
    for idx in starts:
        _check_positive("global_block_indices[]", idx, minimum=0)
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"sparse_attention.global_block_end_indices has {len(ends)} entries but "
            f"global_block_indices has {len(starts)}: they must have the same length"
        )
    for start, end in zip(starts, ends, strict=True):
        if start >= end:
            raise ValueError(
                f"sparse_attention: global block start index {start} must be smaller than its "
                f"end index {end} (global_block_indices / global_block_end_indices)"
            )


class SparsityConfig:
    """Base of every layout: the number of heads, the block size, one layout or one per head.

    Args:
        num_heads: attention heads of the layer.
        block: block size in tokens; the layout has one entry per ``block x block`` tile.
        different_layout_per_head: build a separate layout for each head (patterns that vary
            by head, or random blocks drawn per head); otherwise head 0's layout is copied.
        seed: seed of the generator for random blocks (zerotrain addition, see module doc).
    """

    attention: str = "bidirectional"

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        *,
        seed: int = 0,
    ) -> None:
        _check_positive("num_heads", num_heads)
        _check_positive("block", block)
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1
        self.seed = seed

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero ``(num_heads, seq_len // block, seq_len // block)`` int8 layout
        (DeepSpeed's was int64: 8x the memory for a tensor quadratic in the block count).

        Raises:
            ValueError: ``seq_len`` is not a multiple of ``block``.
        """
        if seq_len % self.block != 0:
            raise ValueError(
                f"sequence length {seq_len} must be a multiple of the block size {self.block} "
                "(SparseSelfAttention pads other lengths itself)"
            )
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int8)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` tokens; see the subclasses."""
        raise NotImplementedError(f"{type(self).__name__} does not define a layout")

    def _rng(self) -> random.Random:
        # A fresh generator per layout, so make_layout(n) is a pure function of the config.
        return random.Random(self.seed)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]


class DenseSparsityConfig(SparsityConfig):
    """Every block is attended: dense attention through the sparse kernel, for comparison."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (arXiv 1904.10509), as DeepSpeed customised it.

    Tokens attend within windows of ``num_local_blocks`` blocks; the last ``num_global_blocks``
    blocks of each window (another group per head with ``num_different_global_patterns``) are
    attended by every later (or every, if bidirectional) query block, and with
    ``horizontal_global_attention`` they attend to everything too.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head, seed=seed)
        _check_positive("num_local_blocks", num_local_blocks)
        _check_positive("num_global_blocks", num_global_blocks)
        _check_positive("num_different_global_patterns", num_different_global_patterns)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"sparse_attention: num_local_blocks ({num_local_blocks}) must be divisible by "
                f"num_global_blocks ({num_global_blocks})"
            )
        _check_attention(attention)
        _check_horizontal(attention, horizontal_global_attention)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"sparse_attention.num_different_global_patterns={num_different_global_patterns} "
                "needs different_layout_per_head=true (with one layout for all heads there is "
                "one global pattern)"
            )
        most = num_local_blocks // num_global_blocks
        if num_different_global_patterns > most:
            raise ValueError(
                f"sparse_attention.num_different_global_patterns={num_different_global_patterns} "
                f"is larger than num_local_blocks / num_global_blocks = {num_local_blocks} / "
                f"{num_global_blocks} = {most}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Windows of ``num_local_blocks`` blocks attend within themselves."""
        num_blocks = layout.shape[1]
        for start in range(0, num_blocks, self.num_local_blocks):
            end = min(start + self.num_local_blocks, num_blocks)
            for row in range(start, end):
                stop = row + 1 if self.attention == "unidirectional" else end
                layout[h, row, start:stop] = 1
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Each window's representative blocks, counted from the window's end for head 0."""
        num_blocks = layout.shape[1]
        first = (
            self.num_local_blocks
            - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        )
        full_windows_end = num_blocks - (num_blocks % self.num_local_blocks)
        starts = list(range(first, full_windows_end, self.num_local_blocks))
        if full_windows_end < num_blocks:
            # A short last window still gets representatives, clamped inside the sequence.
            starts.append(min(full_windows_end + first, num_blocks - self.num_global_blocks))
        for start in starts:
            end = start + self.num_global_blocks
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """ "Fixed" extended with random blocks, windows of varying sizes and explicit global blocks.

    ``local_window_blocks`` lists the sizes of the first windows; the last size repeats to the
    end. ``global_block_indices`` (with optional exclusive ``global_block_end_indices``) name
    the global blocks. As in DeepSpeed, random blocks are drawn from the whole row even when
    ``attention="unidirectional"``; the ones above the diagonal are never used by a causal
    attention.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head, seed=seed)
        _check_positive("num_random_blocks", num_random_blocks, minimum=0)
        if len(local_window_blocks) == 0:
            raise ValueError("sparse_attention.local_window_blocks=[]: give at least one size")
        for size in local_window_blocks:
            _check_positive("local_window_blocks[]", size)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        _check_horizontal(attention, horizontal_global_attention)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """``num_random_blocks`` distinct random key blocks per query block."""
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            layout[h, row, rng.sample(range(num_blocks), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Consecutive windows of the listed sizes; the last size repeats to the end."""
        num_blocks = layout.shape[1]
        start = 0
        sizes = list(self.local_window_blocks)
        while start < num_blocks:
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
            end = min(start + size, num_blocks)
            for row in range(start, end):
                stop = row + 1 if self.attention == "unidirectional" else end
                layout[h, row, start:stop] = 1
            start += size
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Global columns (and rows when horizontal); blocks past the sequence are skipped."""
        num_blocks = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends, strict=True):
            if start >= num_blocks:
                continue
            end = min(end, num_blocks)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _sliding_window(layout: torch.Tensor, h: int, window: int, causal: bool) -> torch.Tensor:
    num_blocks = layout.shape[1]
    _check_fits("num_sliding_window_blocks", window, num_blocks)
    half = window // 2
    for row in range(num_blocks):
        start = max(0, row - half)
        end = row + 1 if causal else min(row + half + 1, num_blocks)
        layout[h, row, start:end] = 1
    return layout


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (arXiv 2007.14062): random blocks, a sliding window and leading global blocks."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head, seed=seed)
        _check_positive("num_random_blocks", num_random_blocks, minimum=0)
        _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        _check_positive("num_global_blocks", num_global_blocks)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """Random key blocks per row, only among earlier blocks when unidirectional."""
        num_blocks = layout.shape[1]
        _check_fits("num_random_blocks", self.num_random_blocks, num_blocks)
        for row in range(num_blocks):
            population = num_blocks if self.attention == "bidirectional" else row + 1
            # Fewer candidates than draws (early causal rows): take them all, as a sample of
            # the whole population would raise.
            count = min(self.num_random_blocks, population)
            layout[h, row, rng.sample(range(population), count)] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """A window of ``num_sliding_window_blocks`` centred on the diagonal."""
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The first ``num_global_blocks`` blocks attend to and are attended by everything."""
        num_blocks = layout.shape[1]
        _check_fits("num_global_blocks", self.num_global_blocks, num_blocks)
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = self._rng()
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (arXiv 2004.05150): a sliding window plus chosen global blocks."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head, seed=seed)
        _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """A window of ``num_sliding_window_blocks`` centred on the diagonal."""
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Global blocks attend to and are attended by every block."""
        num_blocks = layout.shape[1]
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        for start, end in zip(self.global_block_indices, ends, strict=True):
            if start >= num_blocks:
                continue
            end = min(end, num_blocks)
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Purely local attention: each block attends to ``num_sliding_window_blocks`` around it
    (only the earlier half and itself when unidirectional, the default)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: str = "unidirectional",
        *,
        seed: int = 0,
    ) -> None:
        super().__init__(num_heads, block, seed=seed)
        _check_positive("num_sliding_window_blocks", num_sliding_window_blocks)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """The window around each diagonal block."""
        causal = self.attention == "unidirectional"
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=causal)

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


BUILT_IN_LAYOUTS: frozenset[type[SparsityConfig]] = frozenset(
    {
        DenseSparsityConfig,
        FixedSparsityConfig,
        VariableSparsityConfig,
        BigBirdSparsityConfig,
        BSLongformerSparsityConfig,
        LocalSlidingWindowSparsityConfig,
    }
)
"""Layout classes whose heads are copies of head 0 unless ``different_layout_per_head``."""

"""Block-sparse attention in pure torch: trains on any device, memory linear in the sequence.

Each query block gathers only the key and value blocks its layout row names, computes those
scores, and never forms the ``L x L`` matrix. Query blocks are processed in chunks so the
transient scores stay within a fixed budget; backward recomputes them from the saved
log-sum-exp (as flash attention does) instead of keeping them, so what is saved between the
passes is the inputs, the output and one float per query.

Scores are ``scale * q . k + bias + rpe`` where ``bias`` holds the (already additive) masks;
positions outside the layout, at or after ``length`` (block padding), or in the future of a
causal query are excluded. A query with nothing left to attend to gets a zero output and zero
gradients, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.utils.invariant import invariant

# Elements of one chunk's score tensor (float32): 8M = 32 MiB, a few copies live at once.
SCORE_BUDGET = 1 << 23


@dataclass(frozen=True)
class BlockTable:
    """Which key blocks each (head, query block) attends to, padded to a common width.

    Attributes:
        block: block size in tokens.
        cols: ``(H, nb, K)`` int64 key-block indices, ascending; unused slots hold 0.
        valid: ``(H, nb, K)`` bool, False for the unused slots.
        flat: ``(H, nb, K)`` int64 index into keys viewed as ``(H * nb)`` blocks.
    """

    block: int
    cols: torch.Tensor
    valid: torch.Tensor
    flat: torch.Tensor

    @property
    def num_heads(self) -> int:
        """Heads the table covers."""
        return int(self.cols.shape[0])

    @property
    def num_blocks(self) -> int:
        """Query (and key) blocks per head."""
        return int(self.cols.shape[1])

    @property
    def width(self) -> int:
        """Key blocks gathered per query block (the widest row)."""
        return int(self.cols.shape[2])

    @property
    def density(self) -> float:
        """Fraction of the ``nb x nb`` blocks of each head that are computed."""
        return float(self.valid.sum()) / (self.num_heads * self.num_blocks**2)

    @staticmethod
    def from_layout(layout: torch.Tensor, block: int, causal: bool) -> BlockTable:
        """Index the non-zero blocks of a ``(H, nb, nb)`` layout (blocks above the diagonal
        are dropped when ``causal``: no query in them could use a key)."""
        heads = layout.shape[0]
        # One head expanded to all (stride 0): index it once and repeat the small table.
        shared = heads > 1 and layout.stride(0) == 0
        keep = (layout[:1] if shared else layout).bool()
        if causal:
            keep = torch.tril(keep)
        _, nb, _ = keep.shape
        # From the non-zero entries only (row-major, so columns come out ascending): linear
        # in the number of kept blocks, where sorting each row would be quadratic in nb.
        counts = keep.sum(-1)  # (H, nb)
        width = max(int(counts.max()), 1)
        nz = keep.nonzero()  # (nnz, 3): head, row, col
        row_id = nz[:, 0] * nb + nz[:, 1]
        row_start = torch.cumsum(counts.flatten(), 0) - counts.flatten()
        slot = torch.arange(nz.shape[0]) - row_start[row_id]
        cols = torch.zeros(keep.shape[0] * nb, width, dtype=torch.long)
        valid = torch.zeros(keep.shape[0] * nb, width, dtype=torch.bool)
        cols[row_id, slot] = nz[:, 2]
        valid[row_id, slot] = True
        rows = 1 if shared else heads
        cols, valid = cols.view(rows, nb, width), valid.view(rows, nb, width)
        if shared:
            cols = cols.expand(heads, -1, -1).contiguous()
            valid = valid.expand(heads, -1, -1).contiguous()
        flat = cols + torch.arange(heads).view(heads, 1, 1) * nb
        return BlockTable(block=block, cols=cols, valid=valid, flat=flat)

    def to(self, device: torch.device) -> BlockTable:
        """The same table on ``device``."""
        return BlockTable(
            self.block, self.cols.to(device), self.valid.to(device), self.flat.to(device)
        )


@dataclass(frozen=True)
class Extras:
    """What is added to the scores besides ``q . k`` (all already padded to the full length).

    Attributes:
        key_bias: ``(B, Lp)`` additive key-padding mask, or None.
        dense_bias: ``(b, h, Lp, Lp)`` attention mask (``b`` in {1, B}, ``h`` in {1, H}):
            additive float, or a bool keep-mask; or None.
        rpe: ``(b, h, Lp, Lp)`` relative position term, differentiated, or None.
    """

    key_bias: torch.Tensor | None
    dense_bias: torch.Tensor | None
    rpe: torch.Tensor | None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and reductions run in float32 for 16-bit inputs, else in the input's dtype."""
    return torch.promote_types(dtype, torch.float32)


def _gather_dense(
    t: torch.Tensor, heads: int, qpos: torch.Tensor, kpos: torch.Tensor
) -> torch.Tensor:
    # t: (b, h, Lp, Lp) -> (b, H, R, bs, K*bs) at each head's query / key positions.
    hidx = (
        torch.arange(heads, device=t.device)
        if t.shape[1] == heads
        else torch.zeros(heads, dtype=torch.long, device=t.device)
    )
    return t[:, hidx.view(-1, 1, 1, 1), qpos.unsqueeze(0).unsqueeze(-1), kpos.unsqueeze(2)]


class _Chunk:
    """The query blocks ``[r0, r1)``: positions, gathered keys/values and masked scores."""

    def __init__(
        self,
        q: torch.Tensor,
        kf: torch.Tensor,
        vf: torch.Tensor,
        table: BlockTable,
        extras: Extras,
        r0: int,
        r1: int,
        scale: float,
        causal: bool,
        length: int,
    ) -> None:
        batch, heads, _, bs, dim = q.shape
        rows, width = r1 - r0, table.width
        device = q.device
        self.fi = table.flat[:, r0:r1].reshape(-1)
        self.q = q[:, :, r0:r1]
        self.k = kf.index_select(1, self.fi).view(batch, heads, rows, width * bs, dim)
        self.v = vf.index_select(1, self.fi).view(batch, heads, rows, width * bs, dim)
        offsets = torch.arange(bs, device=device)
        self.kpos = (table.cols[:, r0:r1, :, None] * bs + offsets).flatten(-2)  # (H, R, K*bs)
        self.qpos = torch.arange(r0, r1, device=device)[:, None] * bs + offsets  # (R, bs)
        allowed = table.valid[:, r0:r1, :, None].expand(-1, -1, -1, bs).flatten(-2)
        allowed = (allowed & (self.kpos < length)).unsqueeze(2)  # (H, R, 1, K*bs)
        if causal:
            allowed = allowed & (self.kpos.unsqueeze(2) <= self.qpos[None, :, :, None])
        acc = accumulation_dtype(q.dtype)
        scores = torch.matmul(self.q, self.k.transpose(-1, -2)).to(acc) * scale
        if extras.key_bias is not None:
            scores = scores + extras.key_bias[:, self.kpos].unsqueeze(3).to(acc)
        if extras.dense_bias is not None:
            part = _gather_dense(extras.dense_bias, heads, self.qpos, self.kpos)
            if part.dtype == torch.bool:
                allowed = allowed & part  # (b, H, R, bs, K*bs) keep-mask
            else:
                scores = scores + part.to(acc)
        if extras.rpe is not None:
            scores = scores + _gather_dense(extras.rpe, heads, self.qpos, self.kpos).to(acc)
        self.scores = scores.masked_fill(~allowed, float("-inf"))


def _chunk_rows(batch: int, heads: int, bs: int, width: int, num_blocks: int) -> int:
    per_row = batch * heads * bs * width * bs
    return max(1, min(num_blocks, SCORE_BUDGET // max(per_row, 1)))


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rpe: torch.Tensor | None,
        table: BlockTable,
        extras: Extras,
        scale: float,
        causal: bool,
        length: int,
    ) -> torch.Tensor:
        batch, heads, seq, dim = q.shape
        bs, nb = table.block, table.num_blocks
        invariant(seq == nb * bs, f"padded length {seq} != {nb} blocks of {bs}")
        qb = q.view(batch, heads, nb, bs, dim)
        kf = k.reshape(batch, heads * nb, bs, dim)
        vf = v.reshape(batch, heads * nb, bs, dim)
        out = torch.empty_like(qb)
        acc = accumulation_dtype(q.dtype)
        lse = torch.empty(batch, heads, nb, bs, 1, dtype=acc, device=q.device)
        step = _chunk_rows(batch, heads, bs, table.width, nb)
        for r0 in range(0, nb, step):
            r1 = min(nb, r0 + step)
            c = _Chunk(qb, kf, vf, table, extras, r0, r1, scale, causal, length)
            top = c.scores.amax(-1, keepdim=True)
            top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
            p = torch.exp(c.scores - top)
            total = p.sum(-1, keepdim=True)
            o = torch.matmul(p.to(v.dtype), c.v).to(acc)
            out[:, :, r0:r1] = (o / torch.where(total == 0, torch.ones_like(total), total)).to(
                out.dtype
            )
            lse[:, :, r0:r1] = top + torch.log(total)
        out = out.view(batch, heads, seq, dim)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.table, ctx.extras, ctx.scale, ctx.causal, ctx.length = (
            table,
            extras,
            scale,
            causal,
            length,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        table: BlockTable = ctx.table
        extras: Extras = ctx.extras
        batch, heads, _, dim = q.shape
        bs, nb = table.block, table.num_blocks
        qb = q.view(batch, heads, nb, bs, dim)
        kf = k.reshape(batch, heads * nb, bs, dim)
        vf = v.reshape(batch, heads * nb, bs, dim)
        dout = grad_out.contiguous().view(batch, heads, nb, bs, dim)
        acc = accumulation_dtype(q.dtype)
        delta = (dout.to(acc) * out.view_as(dout).to(acc)).sum(-1, keepdim=True)
        # A query with nothing to attend to has lse = -inf; +inf makes its probabilities 0.
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
        dq = torch.zeros_like(qb)
        dkf = torch.zeros_like(kf)
        dvf = torch.zeros_like(vf)
        rpe = extras.rpe
        need_rpe = rpe is not None and ctx.needs_input_grad[3]
        drpe = torch.zeros_like(rpe, dtype=acc) if need_rpe and rpe is not None else None
        step = _chunk_rows(batch, heads, bs, table.width, nb)
        for r0 in range(0, nb, step):
            r1 = min(nb, r0 + step)
            c = _Chunk(qb, kf, vf, table, extras, r0, r1, ctx.scale, ctx.causal, ctx.length)
            rows = r1 - r0
            p = torch.exp(c.scores - lse[:, :, r0:r1])
            d_o = dout[:, :, r0:r1]
            dv = torch.matmul(p.transpose(-1, -2).to(v.dtype), d_o)
            dp = torch.matmul(d_o, c.v.transpose(-1, -2)).to(acc)
            ds = p * (dp - delta[:, :, r0:r1])
            if drpe is not None:
                _scatter_dense(drpe, ds, heads, c.qpos, c.kpos)
            ds_t = ds.to(q.dtype)
            dq[:, :, r0:r1] = torch.matmul(ds_t, c.k) * ctx.scale
            dk = torch.matmul(ds_t.transpose(-1, -2), c.q) * ctx.scale
            shape = (batch, heads * rows * table.width, bs, dim)
            dkf.index_add_(1, c.fi, dk.reshape(shape))
            dvf.index_add_(1, c.fi, dv.reshape(shape))
        grad_rpe = None if drpe is None or rpe is None else drpe.to(rpe.dtype)
        return (
            dq.view_as(q),
            dkf.view_as(k),
            dvf.view_as(v),
            grad_rpe,
            None,
            None,
            None,
            None,
            None,
        )


def _scatter_dense(
    target: torch.Tensor, ds: torch.Tensor, heads: int, qpos: torch.Tensor, kpos: torch.Tensor
) -> None:
    # Accumulate (B, H, R, bs, K*bs) score gradients into target's (b, h, Lp, Lp) positions,
    # summing over the dimensions target broadcasts.
    if target.shape[0] == 1 and ds.shape[0] != 1:
        ds = ds.sum(0, keepdim=True)
    device = target.device
    hidx = (
        torch.arange(heads, device=device)
        if target.shape[1] == heads
        else torch.zeros(heads, dtype=torch.long, device=device)
    )
    bidx = torch.arange(target.shape[0], device=device).view(-1, 1, 1, 1, 1)
    index = (
        bidx,
        hidx.view(1, -1, 1, 1, 1),
        qpos.view(1, 1, *qpos.shape, 1),
        kpos.view(1, heads, kpos.shape[1], 1, kpos.shape[2]),
    )
    target.index_put_(index, ds, accumulate=True)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BlockTable,
    extras: Extras,
    *,
    scale: float,
    causal: bool,
    length: int,
) -> torch.Tensor:
    """Attention of ``(B, H, Lp, D)`` queries over the blocks of ``table``.

    Args:
        q, k, v: contiguous ``(B, H, Lp, D)`` tensors, ``Lp`` a multiple of ``table.block``.
        table: the layout's block table for ``Lp`` tokens.
        extras: additive masks and the relative position term.
        scale: factor on ``q . k``.
        causal: exclude keys after each query.
        length: keys at or after this position are padding and excluded.

    Returns:
        ``(B, H, Lp, D)`` output in ``q``'s dtype.
    """
    return _BlockSparseAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        extras.rpe,
        table,
        extras,
        scale,
        causal,
        length,
    )

"""Random layer-wise token dropping (random-LTD, https://arxiv.org/abs/2211.11586).

The middle layers (``random_ltd_layer_id``) each see a random subset of each sequence's
tokens, in their original order: the layer's inputs are gathered at the kept positions, the
layer runs on the shorter sequence, and its outputs are scattered back; the dropped tokens
pass the layer unchanged (identity, gradient one). How many tokens are kept follows
:class:`~zerotrain.efficiency.schedules.RandomLTDSchedule`; once it reaches the sequence
length every layer sees everything.

Besides the hidden states, the layer's per-token inputs are gathered too: any tensor
argument whose sequence dimension has the sequence's length (position ids, Llama's rotary
``position_embeddings``), and masks over token pairs (4-D ``(..., S, S)``, or the
``model_mask_name`` argument, gathered on both token dimensions).
Kept tokens stay in order, so a causal layer stays causal among them (DeepSpeed's decoder
path instead cut the mask's top-left corner, which is the same for a plain causal mask).

Each layer draws its own subset (DeepSpeed's layout: ``[layers, batch, kept]`` indices per
forward). The draws come from :func:`~zerotrain.efficiency.draws.shared_generator` for the
global batch, and each data-parallel rank takes its samples' rows: every rank makes the
same draw, and one process training the whole global batch makes exactly the draws the
ranks make together (what the parity tests compare).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.efficiency.blocks import hidden_states_of, restore_class, swap_class
from zerotrain.efficiency.draws import shared_generator
from zerotrain.efficiency.schedules import RandomLTDSchedule

_STREAM = 2  # random-LTD's draw stream (layer drop uses 1)


class RandomLTD:
    """Kept-token schedule and per-forward token draws.

    Args:
        schedule: the kept-token schedule.
        seed: seeds the draws (``data_efficiency.seed``).
        batch_first: hidden states are ``(batch, seq, ...)`` (``hidden_state_order``
            ``batch_seq_dim``) rather than ``(seq, batch, ...)``.
        mask_name: the keyword argument holding the layer's attention mask (or None).
        dp_rank, dp_world_size: this rank's place among the data-parallel ranks.
    """

    def __init__(
        self,
        schedule: RandomLTDSchedule,
        seed: int,
        batch_first: bool,
        mask_name: str | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ) -> None:
        self.schedule = schedule
        self.seed = seed
        self.batch_first = batch_first
        self.mask_name = mask_name
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.layers: list[nn.Module] = []
        self._micro_step: int | None = None
        self._drawn: dict[tuple[int, int, int], torch.Tensor] = {}

    def begin_forward(self, global_step: int, micro_step: int) -> int:
        """Advance the schedule and start this training forward's draws; returns the
        number of tokens kept."""
        self._micro_step = micro_step
        self._drawn = {}
        return self.schedule.update(global_step)

    def end_forward(self) -> None:
        """Forget this forward's draws (a forward outside the engine keeps every token)."""
        self._micro_step, self._drawn = None, {}

    def indices(self, layer: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        """This rank's kept positions for wrapped layer ``layer``: ``(batch, kept)``,
        ascending within each row."""
        kept = self.schedule.current
        key = (batch, seq, kept)
        if key not in self._drawn:
            if self._micro_step is None:
                raise RuntimeError("random-LTD indices requested outside a training forward")
            generator = shared_generator(self.seed, _STREAM, self._micro_step)
            total = batch * self.dp_world_size
            scores = torch.rand(len(self.layers), total, seq, generator=generator)
            chosen = scores.argsort(dim=-1)[..., :kept].sort(dim=-1).values
            mine = chosen[:, self.dp_rank * batch : (self.dp_rank + 1) * batch]
            self._drawn[key] = mine.to(device)
        return self._drawn[key][layer]

    def active(self, seq: int) -> bool:
        """Whether a training forward with sequences of ``seq`` tokens drops any."""
        return self._micro_step is not None and self.schedule.current < seq


@dataclass
class _Binding:
    controller: RandomLTD
    index: int


class _RandomLTDCall:
    """Mixed in front of a block's class: gathers the kept tokens around the call."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding: _Binding | None = self.__dict__.get("_zt_random_ltd")
        hidden = hidden_states_of(args, kwargs) if args or kwargs else None
        if (
            binding is None
            or not getattr(self, "training", False)
            or not isinstance(hidden, torch.Tensor)
        ):
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        ltd = binding.controller
        seq_dim = 1 if ltd.batch_first else 0
        seq, batch = hidden.size(seq_dim), hidden.size(1 - seq_dim)
        if not ltd.active(seq):
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        rows = ltd.indices(binding.index, batch, seq, hidden.device)
        part = _Gatherer(rows, seq, seq_dim, ltd.mask_name)
        out = super().__call__(*part.args(args), **part.kwargs(kwargs, bool(args)))  # type: ignore[misc]
        first = out[0] if isinstance(out, tuple) else out
        merged = part.scatter(hidden, first)
        return (merged, *out[1:]) if isinstance(out, tuple) else merged


class _Gatherer:
    """Takes a call's per-token tensors to the kept positions ``rows`` (batch, kept)."""

    def __init__(self, rows: torch.Tensor, seq: int, seq_dim: int, mask_name: str | None):
        self.rows = rows
        self.seq = seq
        self.seq_dim = seq_dim
        self.mask_name = mask_name

    def _along(self, tensor: torch.Tensor, dim: int, batch_dim: int) -> torch.Tensor:
        """``tensor`` at the kept positions along ``dim`` (its batch along ``batch_dim``,
        broadcast when it is 1)."""
        moved = tensor.movedim((batch_dim, dim), (0, 1))
        moved = moved.expand(self.rows.size(0), *moved.shape[1:])
        index = self.rows.reshape(*self.rows.shape, *[1] * (moved.dim() - 2))
        taken = moved.gather(1, index.expand(*self.rows.shape, *moved.shape[2:]))
        return taken.movedim((0, 1), (batch_dim, dim))

    def take(self, value: Any, name: str | None = None) -> Any:
        if isinstance(value, (tuple, list)):
            return type(value)(self.take(v) for v in value)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return value
        seq, batch_dim = self.seq, 1 - self.seq_dim
        pairs = value.dim() >= 4 or (name is not None and name == self.mask_name)
        if pairs and value.dim() >= 3 and value.shape[-1] == seq and value.shape[-2] == seq:
            # A mask over token pairs (batch, heads, S, S): rows and columns.
            rows = self._along(value, value.dim() - 2, 0)
            return self._along(rows, value.dim() - 1, 0)
        if value.shape[self.seq_dim] == seq and value.shape[batch_dim] in (1, self.rows.size(0)):
            return self._along(value, self.seq_dim, batch_dim)
        if name is not None and name == self.mask_name:
            raise ValueError(
                f"random_ltd: the mask {name!r} has shape {tuple(value.shape)}; expected "
                f"(batch, S) or (..., S, S) with S = {seq}"
            )
        return value

    def hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states at the kept positions (never read as a mask)."""
        return self._along(hidden, self.seq_dim, 1 - self.seq_dim)

    def args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args:
            return args
        return (self.hidden(args[0]), *(self.take(a) for a in args[1:]))

    def kwargs(self, kwargs: dict[str, Any], hidden_in_args: bool) -> dict[str, Any]:
        return {
            k: self.hidden(v) if k == "hidden_states" and not hidden_in_args else self.take(v, k)
            for k, v in kwargs.items()
        }

    def scatter(self, hidden: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """``hidden`` with the kept positions replaced by ``part`` (differentiable in both)."""
        batch_dim = 1 - self.seq_dim
        base = hidden.movedim((batch_dim, self.seq_dim), (0, 1))
        update = part.movedim((batch_dim, self.seq_dim), (0, 1))
        index = self.rows.reshape(*self.rows.shape, *[1] * (update.dim() - 2))
        merged = base.scatter(1, index.expand(update.shape), update)
        return merged.movedim((0, 1), (batch_dim, self.seq_dim))


def apply_random_ltd(
    blocks: Sequence[nn.Module], layer_ids: Sequence[int], controller: RandomLTD
) -> list[nn.Module]:
    """Make blocks ``layer_ids`` of ``blocks`` drop tokens as ``controller`` draws; returns
    them."""
    chosen = [blocks[i] for i in sorted(layer_ids)]
    controller.layers = chosen
    for index, block in enumerate(chosen):
        swap_class(block, _RandomLTDCall)
        block.__dict__["_zt_random_ltd"] = _Binding(controller, index)
    return chosen


def remove_random_ltd(blocks: Sequence[nn.Module]) -> None:
    """Undo :func:`apply_random_ltd`."""
    for block in blocks:
        block.__dict__.pop("_zt_random_ltd", None)
        restore_class(block, _RandomLTDCall)

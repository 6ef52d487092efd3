"""This rank's slice of a batch of whole sequences (Ulysses' data side).

Every rank of a sequence group reads the same samples (the data loader splits over the
data axis only); :func:`shard_batch` then keeps this rank's positions of every tensor that
runs along the sequence, split by ``balanced_sizes`` (the first ranks one more position when
the length does not divide: nothing is padded). Three things a model needs to train on a
slice exactly as on the whole sequence come with it:

- ``position_ids``: the global positions of the slice (added unless given).
- aligned targets: a causal LM's ``labels`` are shifted by one *before* the split
  (``shift_labels``, the last position ignored with -100), so that the token after a slice
  boundary still counts, and transformers' loss skips its own shift. ``targets`` and
  ``shift_labels`` are taken as already aligned.
- ``num_items_in_batch``: the group's number of counted targets divided by the degree P.
  A loss of ``sum / num_items_in_batch`` (transformers' convention) on each rank, averaged
  over the P ranks by the gradient reduction, is the mean over the whole sequence, also
  when the slices hold different numbers of counted tokens.

An ``attention_mask`` of all ones is dropped (attention is causal by itself); one with
padding is refused: padded batches do not split by position (pack or trim them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence.attention import balanced_sizes

IGNORE_INDEX = -100
ALIGNED_TARGETS = ("shift_labels", "targets")


def sequence_slice(length: int, comm: Communicator) -> slice:
    """This rank's positions of a sequence of ``length`` (balanced, first ranks longer)."""
    sizes = balanced_sizes(length, comm.world_size)
    start = sum(sizes[: comm.rank])
    return slice(start, start + sizes[comm.rank])


def shard_batch(
    batch: Mapping[str, Any],
    comm: Communicator,
    *,
    seq_dim: int = 1,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """This rank's slice of ``batch`` (a mapping of model keyword arguments holding whole
    sequences) with ``position_ids``, aligned targets and ``num_items_in_batch``.

    Raises:
        ValueError: no tensor to take the sequence length from, a padding mask, or a
            sequence shorter than the degree.
    """
    out = dict(batch)
    length = _sequence_length(out, seq_dim)
    if length < comm.world_size:
        raise ValueError(
            f"a sequence of {length} positions cannot be split over the sequence-parallel "
            f"degree {comm.world_size}: every rank needs at least one position"
        )
    mask = out.pop("attention_mask", None)
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError(
            "attention_mask has padding (zeros): Ulysses sequence parallelism splits the "
            "batch by position, which a padded batch does not survive; pack the sequences "
            "(no padding) or trim them to a common length"
        )
    reference = next(t for t in out.values() if _runs_along(t, seq_dim, length))
    if "labels" in out and "shift_labels" not in out:
        labels = out["labels"]
        out["shift_labels"] = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    if "position_ids" not in out:
        positions = torch.arange(length, device=reference.device)
        out["position_ids"] = positions.expand(reference.shape[0], length)
    targets = next((out[k] for k in ("shift_labels", *ALIGNED_TARGETS) if k in out), None)
    given = out.get("num_items_in_batch")
    if given is not None:
        out["num_items_in_batch"] = given / comm.world_size
    elif targets is not None:
        counted = (targets != ignore_index).sum().to(torch.float32)
        out["num_items_in_batch"] = counted / comm.world_size
    where = sequence_slice(length, comm)
    return {
        key: value.narrow(seq_dim, where.start, where.stop - where.start).contiguous()
        if _runs_along(value, seq_dim, length)
        else value
        for key, value in out.items()
    }


def _runs_along(value: Any, seq_dim: int, length: int) -> bool:
    return (
        isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == length
    )


class ShardedBatches:
    """The tensors ``shard_batch`` returned, by identity (weakly: an entry goes with its
    tensor), with the global length of the sequence they were cut from."""

    def __init__(self) -> None:
        self._lengths: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def remember(self, values: Iterable[Any], length: int) -> None:
        for value in values:
            if isinstance(value, torch.Tensor):
                self._lengths[value] = length

    def length_of(self, values: Iterable[Any]) -> int | None:
        """The global length of the first of ``values`` that is a remembered tensor."""
        for value in values:
            if isinstance(value, torch.Tensor) and value in self._lengths:
                return int(self._lengths[value])
        return None


def batch_sequence_length(batch: Mapping[str, Any], seq_dim: int = 1) -> int:
    """The length of the whole sequences of ``batch`` (what ``shard_batch`` cuts).

    Raises:
        ValueError: no tensor to take it from.
    """
    return _sequence_length(batch, seq_dim)


def _sequence_length(batch: Mapping[str, Any], seq_dim: int) -> int:
    for key in ("input_ids", *ALIGNED_TARGETS, "labels", "inputs_embeds", "idx"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim:
            return int(value.shape[seq_dim])
    raise ValueError(
        f"shard_batch: found no sequence in the batch (keys {sorted(batch)}); it needs one of "
        "input_ids, labels, targets, shift_labels, inputs_embeds or idx with a sequence "
        f"dimension {seq_dim}"
    )

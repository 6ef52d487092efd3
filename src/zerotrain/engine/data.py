"""The distributed DataLoader ``initialize`` builds from ``training_data``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedDataLoader:
    """A DataLoader over this rank's share of ``dataset``, reshuffled every epoch.

    Each iteration over the loader is one epoch; the sampler's epoch advances automatically,
    so every epoch sees a different order (the same on every run with the same seed).

    Args:
        dataset: a map-style dataset.
        micro_batch_size: samples per batch on this rank.
        rank / world_size: this rank's place among the data-parallel ranks.
        collate_fn: batch builder (DataLoader's default when None).
        drop_last: drop the incomplete last batch (and uneven tail samples).
        seed: base seed of the shuffle.
        pin_memory: pin host memory (useful when training on CUDA).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        micro_batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        seed: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=drop_last,
        )
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            pin_memory=pin_memory,
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        yield from self.loader

    def state_dict(self) -> dict[str, int]:
        """Position of the loader (the epoch about to start)."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the epoch saved by :meth:`state_dict`."""
        self.epoch = int(state["epoch"])

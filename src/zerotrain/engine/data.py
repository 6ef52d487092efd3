"""The distributed DataLoader ``initialize`` builds from ``training_data``, resumable
mid-epoch and across world sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableDistributedSampler(Sampler[int]):
    """This rank's share of a seeded global shuffle, starting at any global position.

    Each epoch shuffles all indices with ``seed + epoch`` (as ``DistributedSampler`` does);
    rank r of N takes positions ``start + r, start + r + N, ...`` of that order. After every
    rank drew k samples, exactly the first ``start + k * N`` positions are consumed, whatever
    N is: a run resumed with a different number of ranks continues with the next unseen
    samples.
    """

    def __init__(
        self, size: int, rank: int, world_size: int, seed: int = 0, drop_last: bool = False
    ) -> None:
        self.size = size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # global position the epoch resumes at

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        rest = torch.randperm(self.size, generator=generator).tolist()[self.start :]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.world_size]
        # Pad with the first unseen samples again, so every rank gets as many.
        pad = -len(rest) % self.world_size
        return rest + (rest * (1 + pad // max(1, len(rest))))[:pad]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.rank :: self.world_size])

    def __len__(self) -> int:
        remaining = self.size - self.start
        if self.drop_last:
            return remaining // self.world_size
        return -(-remaining // self.world_size)


class DistributedDataLoader:
    """A DataLoader over this rank's share of ``dataset``, reshuffled every epoch.

    Each iteration over the loader is one epoch (the same order on every run with the same
    seed). Its ``state_dict`` records the epoch and how many samples of it all ranks together
    have drawn, so a checkpointed run resumes with the next unseen batch, also with a
    different number of ranks.

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
        self.sampler = ResumableDistributedSampler(
            len(dataset),  # type: ignore[arg-type]
            rank,
            world_size,
            seed=seed,
            drop_last=drop_last,
        )
        self.micro_batch_size = micro_batch_size
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            pin_memory=pin_memory,
            # Its own generator: each new iterator draws a worker seed, which must not
            # advance the global RNG (a resumed run would see different dropout masks).
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0  # the epoch the next iteration starts (or continues)
        self.position = 0  # global samples of that epoch already drawn
        self._resume = False
        self._unfinished = False  # an iteration was started and abandoned

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if not self._resume:
            if self._unfinished:
                self.epoch += 1  # a new iteration is a new epoch, as with a plain DataLoader
            self.position = 0
        self._resume = False
        self._unfinished = True
        self.sampler.epoch, self.sampler.start = self.epoch, self.position
        step = self.micro_batch_size * self.sampler.world_size
        for batch in self.loader:
            self.position += step
            yield batch
        self.epoch += 1
        self.position = 0
        self._unfinished = False

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: the epoch in progress (or next) and the global samples
        of it drawn so far."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at :meth:`state_dict`'s position: the next iteration continues that epoch."""
        self.epoch = int(state["epoch"])
        self.position = int(state.get("position", 0))
        self._resume = self.position > 0
        self._unfinished = False

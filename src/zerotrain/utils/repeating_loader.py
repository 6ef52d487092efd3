"""``RepeatingLoader``: DeepSpeed's endless wrapper around a data loader."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RepeatingLoader(Generic[T]):
    """Iterate ``loader`` forever, starting it over each time it is exhausted (as
    ``deepspeed.utils.RepeatingLoader``; a pipeline's ``train_batch(data_iter)`` reads one
    micro-batch per call). A loader with a ``DistributedSampler`` gets ``set_epoch`` with the
    next epoch before each restart, so every pass reshuffles (DeepSpeed's did not, and
    repeated the first epoch's order)."""

    def __init__(self, loader: Iterable[T]) -> None:
        self.loader = loader
        self.epoch = 0
        self.data_iter: Iterator[T] = iter(loader)

    def __iter__(self) -> RepeatingLoader[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)

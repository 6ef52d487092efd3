"""State that belongs to one rank of one layout and to nothing else: the 1-bit optimizers'
error-feedback buffers (and 0/1 Adam's local-step buffers).

Each rank stores its own under ``local.*`` keys of its shard file, with a fingerprint of
what they depend on (the optimizer, the number of ranks, the buffer sizes). A job loading
the checkpoint gets them back only when its fingerprint is the same; otherwise the
optimizer starts them from zero, and the log says so. Every rank of a job has the same
fingerprint (it describes the job, not the rank), so all of them decide alike.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

PREFIX = "local."


@runtime_checkable
class RankLocalStateful(Protocol):
    """An optimizer with rank-local state."""

    def rank_local_fingerprint(self) -> str:
        """What the state depends on."""
        ...

    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, by name."""
        ...

    def load_rank_local_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Restore them (None: they do not apply; start over)."""
        ...


def capture(optimizer: Any) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """``(index entry, tensors to store)`` for this rank (``(None, {})`` without any)."""
    if not isinstance(optimizer, RankLocalStateful):
        return None, {}
    tensors = optimizer.rank_local_state()
    entry = {"fingerprint": optimizer.rank_local_fingerprint(), "keys": sorted(tensors)}
    return entry, {PREFIX + k: v.detach().contiguous() for k, v in tensors.items()}


def restore(
    optimizer: Any,
    saved: dict[str, Any] | None,
    read: Any,
    where: str,
    rank: int,
) -> None:
    """Give ``optimizer`` its saved state back when it applies (``read(key)`` reads a
    tensor of this rank's file), else have it start over, saying why (rank 0 logs)."""
    if not isinstance(optimizer, RankLocalStateful):
        return
    mine = optimizer.rank_local_fingerprint()
    if saved is not None and saved.get("fingerprint") == mine:
        tensors = {k: read(PREFIX + k) for k in saved["keys"]}
        missing = [k for k, v in tensors.items() if v is None]
        if not missing:
            optimizer.load_rank_local_state(tensors)
            return
        why = f"its entries {missing} are missing"
    elif saved is None:
        why = "it holds none for this rank"
    else:
        why = f"it was saved by {saved.get('fingerprint')!r}, this job is {mine!r}"
    if rank == 0:
        log.warning(
            "%s: the optimizer's rank-local state (1-bit error feedback, local-step buffers) "
            "is reset to zero: %s",
            where,
            why,
        )
    optimizer.load_rank_local_state(None)

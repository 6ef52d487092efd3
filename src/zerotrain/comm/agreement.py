"""Do all ranks hold the same values? And if not, which values differ, and how?

A job whose ranks were given different configs (a learning rate, a batch size) or built
different models trains silently wrong, or hangs in a collective that one rank never joins.
``disagreements`` compares named values across the ranks of a communicator with one small
all-reduce of their hashes and, only when some differ, one all-gather of the differing
values' text, so the error can say "'optimizer.params.lr': rank 0 has 0.001, rank 1 has
0.002" instead of "something differs".
"""

from __future__ import annotations

import hashlib
import os
import socket
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from zerotrain.comm.collectives import Communicator

MISSING = "<missing>"
_SHOWN = 5  # differing items named in a message; the rest are counted
_VALUE_CHARS = 200  # characters of each rank's value shown


def _hash48(text: str) -> float:
    # 48 bits: exact in a float64, the dtype every backend reduces.
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big"))


def disagreements(comm: Communicator, items: Sequence[tuple[str, str]]) -> list[str]:
    """Compare ``items`` (name, value) position by position across all ranks.

    Collective: every rank must call it, with its own items (their counts may differ: a
    missing position reads as ``<missing>``).

    Returns:
        One line per differing position (at most a few, then a count), naming the item and
        each rank's value; empty when every rank holds the same items. The same on every
        rank.
    """
    if comm.world_size == 1:
        return []
    count = int(comm.all_reduce_floats([float(len(items))], op="max")[0])
    texts = [f"{name}={value}" for name, value in items] + [MISSING] * (count - len(items))
    hashes = torch.tensor([_hash48(t) for t in texts] + [0.0], dtype=torch.float64)
    # Max and min in one reduction: (v, -v) under max.
    both = torch.cat([hashes, -hashes]).to(comm.device)
    comm.all_reduce(both, purpose="control", op="max")
    high, low = both[: count + 1].cpu(), -both[count + 1 :].cpu()
    differing = [k for k in range(count) if high[k] != low[k]]
    if not differing:
        return []
    shown = differing[:_SHOWN]
    per_rank = _gather_texts(comm, [_describe(items, k) for k in shown])
    lines = []
    for j, k in enumerate(shown):
        name = next((values[j][0] for values in per_rank if values[j][0] != MISSING), f"item {k}")
        values = ", ".join(f"rank {r} has {v[j][1]}" for r, v in enumerate(per_rank))
        lines.append(f"'{name}': {values}")
    if len(differing) > len(shown):
        lines.append(f"... and {len(differing) - len(shown)} more")
    return lines


def failed_ranks(comm: Communicator, failed: bool) -> list[int]:
    """The ranks that report a failure, the same list on every rank (collective: one small
    all-reduce), so that every rank can stop together and say which ranks failed instead
    of leaving the others waiting in their next collective."""
    flags = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    flags[comm.rank] = 1.0 if failed else 0.0
    if comm.world_size > 1:
        comm.all_reduce(flags, purpose="control")
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def filesystem_needs(comm: Communicator, needs: Mapping[Path, int]) -> dict[Path, tuple[int, int]]:
    """For each of this rank's paths: the bytes every rank will write to that filesystem
    of this machine, and how many ranks those are (collective: every rank calls it; one
    small all-reduce). Ranks share a filesystem when host name and device are equal, so
    the sum is what that disk must have free."""
    world, paths = comm.world_size, sorted(needs)
    # One sum-reduction of one-hot rows is an all-gather of (filesystem key, bytes).
    table = [0.0] * (2 * world * max(1, len(paths)))
    keys = [_filesystem_key(path) for path in paths]
    for k, path in enumerate(paths):
        row = 2 * (k * world + comm.rank)
        table[row], table[row + 1] = keys[k], float(needs[path])
    totals = comm.all_reduce_floats(table)
    found = {}
    for k, path in enumerate(paths):
        rows = [
            (totals[2 * (k * world + r)], totals[2 * (k * world + r) + 1]) for r in range(world)
        ]
        sharing = [need for key, need in rows if key == keys[k]]
        found[path] = (int(sum(sharing)), len(sharing))
    return found


def _filesystem_key(path: Path) -> float:
    """Equal on ranks whose ``path`` is on the same filesystem of the same machine."""
    device = os.stat(path).st_dev if path.exists() else -1
    return float(zlib.crc32(f"{socket.gethostname()}:{device}".encode()) + 1)


def _describe(items: Sequence[tuple[str, str]], k: int) -> tuple[str, str]:
    if k >= len(items):
        return MISSING, MISSING
    name, value = items[k]
    return name, value[:_VALUE_CHARS]


def _gather_texts(comm: Communicator, mine: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Every rank's ``mine`` (the same number of pairs on every rank), in rank order."""
    # ASCII's record and unit separators between items and within them; zero bytes pad.
    encoded = "\x1e".join(f"{name}\x1f{value}" for name, value in mine).encode()
    width = int(comm.all_reduce_floats([float(len(encoded))], op="max")[0])
    local = torch.zeros(width, dtype=torch.uint8)
    local[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    gathered = torch.empty(width * comm.world_size, dtype=torch.uint8, device=comm.device)
    comm.all_gather_into(gathered, local.to(comm.device), purpose="control")
    out = []
    for r in range(comm.world_size):
        raw = bytes(gathered[r * width : (r + 1) * width].cpu().tolist()).rstrip(b"\x00")
        pairs = [p.split("\x1f", 1) for p in raw.decode(errors="replace").split("\x1e")]
        out.append([(p[0], p[1] if len(p) > 1 else "") for p in pairs])
    return out

"""All-to-all and point-to-point on one host: gloo's TCP loopback vs the shared-memory arena.

For each world size and message size (the bytes each rank sends), the median of
``--repeats`` timed calls (after one warm-up) on rank 0, each started right after a barrier:

* all-to-all (even splits): torch's ``all_to_all_single`` over gloo with no checks, the
  ``Communicator`` over gloo (signature and split checks: two small collectives first), and
  the ``Communicator`` over its shared-memory arena;
* a ring exchange (every rank sends its message to the next rank and receives the previous
  rank's, both at once): ``Communicator.exchange`` over gloo with and without the pairwise
  header check, and the same traffic as an all-to-all through the arena (splits zero except
  towards the next rank), an upper bound on what a shared-memory point-to-point path costs;
* the same ring through the pairwise shared-memory channels (``comm/shm_p2p.py``): every
  message in the channel (``ZEROTRAIN_SHM_P2P_MIN_BYTES=0``), and the header in the channel
  with the payload over gloo (what messages below the threshold get).

    OMP_NUM_THREADS=1 python benchmarks/p2p_all_to_all.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.comm import Communicator, P2POp
from zerotrain.testing.dist import run_distributed

COLUMNS = (
    "a2a torch/gloo",
    "a2a gloo checked",
    "a2a shm",
    "ring gloo",
    "ring gloo + header",
    "ring shm (a2a)",
    "ring shm p2p",
    "ring shm header + gloo",
)


def _median_ms(fn: Callable[[], object], barrier: Callable[[], None], repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        barrier()
        start = time.perf_counter()
        fn()
        if i:  # the first call warms up buffers and connections
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _runs(
    comms: tuple[Communicator, ...], x: torch.Tensor, y: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """Each measured call, sending ``x`` and receiving into ``y``."""
    shared, gloo, unchecked, channel, header_only = comms
    rank, n = shared.rank, shared.world_size
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    ring = [P2POp.send(x, nxt, purpose="bench"), P2POp.recv(y, prev, purpose="bench")]
    ring_in = [x.numel() if j == nxt else 0 for j in range(n)]
    ring_out = [x.numel() if i == prev else 0 for i in range(n)]
    return {
        "a2a torch/gloo": lambda: dist.all_to_all_single(y, x),
        "a2a gloo checked": lambda: gloo.all_to_all(y, x, purpose="bench"),
        "a2a shm": lambda: shared.all_to_all(y, x, purpose="bench"),
        "ring gloo": lambda: unchecked.exchange(ring),
        "ring gloo + header": lambda: gloo.exchange(ring),
        "ring shm (a2a)": lambda: shared.all_to_all(
            y, x, input_split_sizes=ring_in, output_split_sizes=ring_out, purpose="bench"
        ),
        "ring shm p2p": lambda: channel.exchange(ring),
        "ring shm header + gloo": lambda: header_only.exchange(ring),
    }


def _measure(sizes: list[int], repeats: int, columns: list[str]) -> dict[tuple[int, str], float]:
    # Read by each constructor: every message through the channel, then none.
    os.environ["ZEROTRAIN_SHM_P2P_MIN_BYTES"] = "0"
    channel = Communicator()
    os.environ["ZEROTRAIN_SHM_P2P_MIN_BYTES"] = str(1 << 40)
    header_only = Communicator()
    del os.environ["ZEROTRAIN_SHM_P2P_MIN_BYTES"]
    shared = Communicator()
    gloo = Communicator(shared_memory=False)
    os.environ["ZEROTRAIN_VERIFY_COLLECTIVES"] = "0"  # read by the next constructor
    unchecked = Communicator(shared_memory=False)
    if not shared.uses_shared_memory:
        raise RuntimeError("shared-memory collectives are unavailable here")
    n = shared.world_size
    out: dict[tuple[int, str], float] = {}
    for size in sizes:
        numel = size // 4 // n * n
        comms = (shared, gloo, unchecked, channel, header_only)
        runs = _runs(comms, torch.randn(numel), torch.empty(numel))
        for name in columns:
            out[(size, name)] = _median_ms(runs[name], shared.barrier, repeats)
    return out


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--columns", default=",".join(COLUMNS), help="a subset, comma-separated")
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    columns = args.columns.split(",")
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        parser.error(f"unknown columns {unknown}; known: {list(COLUMNS)}")
    head = " | ".join(f"{c} ms" for c in columns)
    print(f"| ranks | bytes per rank | {head} |")
    print("|---|---|" + "---|" * len(columns))
    for world in (int(w) for w in args.world_sizes.split(",")):
        results = run_distributed(_measure, world, sizes, args.repeats, columns, timeout=1800)[0]
        for size in sizes:
            cells = " | ".join(f"{results[(size, c)]:.3f}" for c in columns)
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"| {world} | {label} | {cells} |")


if __name__ == "__main__":
    main()

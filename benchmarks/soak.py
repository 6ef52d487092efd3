"""Soak: a long run that must not grow. 4 CPU ranks train a GPT at ZeRO stage 3 with the
optimizer states and parameter shards offloaded to NVMe swap files, saving a checkpoint
every 20 steps (``keep_last`` 2), for ``--minutes`` of wall clock (default 120).

After every step each rank records its resident memory (RSS), open file descriptors,
threads and the bytes in its swap directory; rank 0 also records /dev/shm (bytes used and
zerotrain segment names) and the checkpoint directory's bytes. The records stream to one
CSV per rank, so a run cut short still leaves its data.

At the end: a PNG of every series against the step, and per rank the slope of RSS over the
second half of the run (a least-squares line: MiB per 1,000 steps, and what it adds over
that half) next to the noise (the standard deviation of RSS around the line). Goal: flat
within noise, i.e. the half's growth below twice the noise plus 1 MiB (one allocator
chunk or so: RSS moves in whole chunks).

    OMP_NUM_THREADS=1 python benchmarks/soak.py --minutes 120 --out /tmp/zt/soak
    python benchmarks/soak.py --report /tmp/zt/soak   # the table and PNG again, from the CSVs
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from zerotrain.utils.memory import current_rss_bytes

FIELDS = (
    "step",
    "seconds",
    "loss",
    "rss_mib",
    "fds",
    "threads",
    "swap_mib",
    "shm_used_mib",
    "shm_mapped_mib",
    "shm_names",
    "checkpoints_mib",
)
CHECKPOINT_EVERY = 20
# RSS moves in steps of whole allocator chunks (0.25-2 MiB here), a few in thousands of
# steps, so a flat series can have ~0 noise and still one late step: growth up to this
# much on top of twice the noise counts as flat. A leak of 1 KiB per step would add
# several MiB over the second half of a 2-hour run.
_ALLOCATOR_RESOLUTION_MIB = 1.0
WORLD = 4


def _config(nvme: str) -> dict[str, Any]:
    offload = {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": offload,
            "offload_param": {**offload, "max_in_cpu": 0},
        },
        "checkpoint": {"keep_last": 2},
        # Field configs print rarely; nothing may pile up in between.
        "steps_per_print": 10**9,
    }


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            # A file may go while we look (an old checkpoint being pruned).
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def _shm_mapped_mib() -> float:
    """This process's own shared-memory segments: the /dev/shm files it maps (each counted
    once), named or already unlinked. Unlike /dev/shm's usage, other jobs on the machine do
    not count."""
    sizes: dict[str, int] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            inode = fields[4]
            sizes[inode] = sizes.get(inode, 0) + end - start
    return sum(sizes.values()) / 2**20


def _swap_dirs(nvme: Path, rank: int) -> list[Path]:
    host = socket.gethostname()
    return [p for p in nvme.glob(f"zerotrain-swap-{host}-*-rank{rank}-*") if p.is_dir()]


def _sample(rank: int, nvme: Path, checkpoints: Path) -> dict[str, float]:
    row = {
        "rss_mib": current_rss_bytes() / 2**20,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "swap_mib": sum(_tree_bytes(p) for p in _swap_dirs(nvme, rank)) / 2**20,
        "shm_used_mib": float("nan"),
        "shm_mapped_mib": _shm_mapped_mib(),
        "shm_names": float("nan"),
        "checkpoints_mib": float("nan"),
    }
    if rank == 0:
        row["shm_used_mib"] = shutil.disk_usage("/dev/shm").used / 2**20
        row["shm_names"] = len([n for n in os.listdir("/dev/shm") if n.startswith("zerotrain")])
        row["checkpoints_mib"] = _tree_bytes(checkpoints) / 2**20
    return row


def _rank(out: str, nvme: str, minutes: float, layers: int, width: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import zerotrain
    from zerotrain.examples.corpus import load_corpus
    from zerotrain.examples.gpt import GPT, GPTConfig

    rank = dist.get_rank()
    cfg = GPTConfig(block_size=64, n_layer=layers, n_head=4, n_embd=width, bias=False)
    torch.manual_seed(0)
    config = _config(nvme)
    engine, *_ = zerotrain.initialize(model=GPT(cfg), config=config)
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 + rank)
    checkpoints = Path(out) / "checkpoints"
    deadline = time.monotonic() + minutes * 60
    started = time.monotonic()
    step = 0
    with open(Path(out) / f"rank{rank}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        done = False
        while not done:
            starts = torch.randint(0, len(data) - cfg.block_size - 1, (4,), generator=gen)
            window = data[starts[:, None] + torch.arange(cfg.block_size + 1)]
            loss = engine(window[:, :-1], window[:, 1:])
            engine.backward(loss)
            engine.step()
            step += 1
            if step % CHECKPOINT_EVERY == 0:
                engine.save_checkpoint(checkpoints)
                # Rank 0's clock decides for everyone, at the checkpoint (no extra sync).
                flag = [1.0 if rank == 0 and time.monotonic() >= deadline else 0.0]
                done = engine.comm.all_reduce_floats(flag)[0] > 0
            row = _sample(rank, Path(nvme), checkpoints)
            writer.writerow(
                {"step": step, "seconds": time.monotonic() - started, "loss": loss.item(), **row}
            )
            if step % CHECKPOINT_EVERY == 0:
                f.flush()
    engine.destroy()
    return {"steps": step, "seconds": time.monotonic() - started}


def _read(out: Path) -> dict[int, dict[str, list[float]]]:
    series: dict[int, dict[str, list[float]]] = {}
    for path in sorted(out.glob("rank*.csv")):
        rank = int(path.stem[4:])
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        # (CSVs written before a field existed read it as NaN.)
        series[rank] = {k: [float(r.get(k) or "nan") for r in rows] for k in FIELDS}
    return series


def _slope(steps: list[float], rss: list[float]) -> dict[str, float]:
    """Least-squares line of RSS over the second half: MiB per 1,000 steps, the growth it
    implies over that half, and the noise around it."""
    import numpy as np

    half = len(steps) // 2
    x, y = np.asarray(steps[half:]), np.asarray(rss[half:])
    slope, intercept = np.polyfit(x, y, 1)
    noise = float(np.std(y - (slope * x + intercept)))
    growth = float(slope * (x[-1] - x[0]))
    return {
        "mib_per_1000_steps": float(slope * 1000),
        "growth_mib": growth,
        "noise_mib": noise,
        "flat": abs(growth) <= 2 * noise + _ALLOCATOR_RESOLUTION_MIB,
        "first": float(y[0]),
        "last": float(y[-1]),
    }


def _plot(series: dict[int, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rss_mib", "resident memory (MiB)", "all"),
        ("fds", "open file descriptors", "all"),
        ("swap_mib", "swap directory (MiB)", "all"),
        ("threads", "threads", "all"),
        ("shm_mapped_mib", "/dev/shm mapped by the rank (MiB)", "all"),
        ("checkpoints_mib", "checkpoint directory (MiB)", 0),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for ax, (key, title, who) in zip(axes.flat, panels, strict=True):
        for rank, s in series.items():
            if who == "all" or who == rank:
                ax.plot(s["step"], s[key], lw=0.8, label=f"rank {rank}")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle("Soak: 4 ranks, ZeRO-3 + NVMe offload, checkpoint every 20 steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(out: Path, png: Path) -> dict[str, Any]:
    series = _read(out)
    summary: dict[str, Any] = {"ranks": {}}
    for rank, s in series.items():
        second = len(s["step"]) // 2
        summary["ranks"][rank] = {
            "steps": int(s["step"][-1]),
            "minutes": s["seconds"][-1] / 60,
            "rss": _slope(s["step"], s["rss_mib"]),
            "fds": (min(s["fds"][second:]), max(s["fds"][second:])),
            "threads": (min(s["threads"][second:]), max(s["threads"][second:])),
            "swap_mib": (min(s["swap_mib"][second:]), max(s["swap_mib"][second:])),
            "shm_mapped_mib": (
                min(s["shm_mapped_mib"][second:]),
                max(s["shm_mapped_mib"][second:]),
            ),
        }
    zero = series[0]
    half = len(zero["step"]) // 2
    summary["shm_used_mib"] = (min(zero["shm_used_mib"][half:]), max(zero["shm_used_mib"][half:]))
    summary["shm_names_max"] = max(zero["shm_names"])
    summary["checkpoints_mib"] = (
        min(zero["checkpoints_mib"][half:]),
        max(zero["checkpoints_mib"][half:]),
    )
    summary["loss"] = (zero["loss"][0], zero["loss"][-1])
    _plot(series, png)
    print(_table(summary))
    return summary


def _table(summary: dict[str, Any]) -> str:
    lines = [
        "| rank | steps | minutes | RSS at half -> end MiB | RSS slope MiB/1000 steps | "
        "growth over 2nd half MiB | noise (std) MiB | flat | fds | threads | swap MiB | "
        "/dev/shm mapped MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, r in summary["ranks"].items():
        rss = r["rss"]
        lines.append(
            f"| {rank} | {r['steps']} | {r['minutes']:.0f} | {rss['first']:.1f} -> "
            f"{rss['last']:.1f} | {rss['mib_per_1000_steps']:+.3f} | {rss['growth_mib']:+.2f} "
            f"| {rss['noise_mib']:.2f} | {'yes' if rss['flat'] else 'NO'} | "
            f"{r['fds'][0]:.0f}-{r['fds'][1]:.0f} | {r['threads'][0]:.0f}-{r['threads'][1]:.0f}"
            f" | {r['swap_mib'][0]:.1f}-{r['swap_mib'][1]:.1f} | "
            f"{r['shm_mapped_mib'][0]:.1f}-{r['shm_mapped_mib'][1]:.1f} |"
        )
    shm, ckpt = summary["shm_used_mib"], summary["checkpoints_mib"]
    lines.append("")
    lines.append(
        f"/dev/shm used machine-wide (other jobs included) over the second half: "
        f"{shm[0]:.1f}-{shm[1]:.1f} MiB; zerotrain segment "
        f"names at most {summary['shm_names_max']:.0f}; checkpoint directory "
        f"{ckpt[0]:.1f}-{ckpt[1]:.1f} MiB; loss {summary['loss'][0]:.3f} -> "
        f"{summary['loss'][1]:.3f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=120.0)
    parser.add_argument("--out", default="/tmp/zt/soak", help="CSV, JSON and checkpoints")
    parser.add_argument("--nvme-path", default=None, help="swap root (default: OUT/swap)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--png", default="benchmarks/soak.png")
    parser.add_argument("--report", metavar="OUT", help="only re-read OUT's CSVs")
    args = parser.parse_args(argv)
    if args.report:
        report(Path(args.report), Path(args.png))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zerotrain.testing.dist import run_distributed

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    nvme = Path(args.nvme_path or out / "swap")
    nvme.mkdir(parents=True, exist_ok=True)
    ranks = run_distributed(
        _rank,
        WORLD,
        str(out),
        str(nvme),
        args.minutes,
        args.layers,
        args.width,
        timeout=args.minutes * 60 + 900,
        comm_timeout=600,
    )
    summary = report(out, Path(args.png))
    summary["run"] = ranks
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    left = list(nvme.iterdir())
    print(f"swap root after the run: {len(left)} entries {[p.name for p in left]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

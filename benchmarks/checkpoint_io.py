"""Checkpoint throughput and consolidation memory.

Two ranks train a stack of linear layers (ZeRO stage 3, Adam) for one step, then each rank
(1) saves a zerotrain checkpoint, (2) ``torch.save``s the same tensors it holds (its shards of
parameters and both Adam moments) to its own file, and each is loaded back, in interleaved
repeats; the median time of each is reported as GB/s of checkpoint bytes. Finally
``zerotrain consolidate`` runs in a child process and its peak RSS is compared with the
largest parameter and the model's size.

    python benchmarks/checkpoint_io.py --gb 1.0 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.checkpoint import regions
from zerotrain.testing.dist import run_distributed


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def _rank_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """What this rank holds: its parameter shards and Adam moments (clones for torch.save)."""
    out = {}
    for unit in engine.strategy.units:
        out[f"u{unit.index}.param"] = unit.buffer.owned_slice(*unit.owned).clone()
    for j, slot in enumerate(regions.optimizer_slots(engine.checkpoint_state())):
        for key, value in engine.optimizer.state[slot.tensor].items():
            if value.numel() > 1:
                out[f"s{j}.{key}"] = value.clone()
    return out


def _worker(width: int, layers: int, root: str, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model(width, layers)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(2, width)
    engine.backward(engine(x).square().mean())
    engine.step()
    mine = _rank_tensors(engine)
    rank = dist.get_rank()
    times: dict[str, list[float]] = {k: [] for k in ("save", "load", "torch.save", "torch.load")}
    for r in range(repeats):
        ckpt = Path(root) / "zt"
        dist.barrier()
        t = time.perf_counter()
        engine.save_checkpoint(ckpt, tag=f"r{r}", keep_last=1)
        dist.barrier()
        times["save"].append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_checkpoint(ckpt)
        dist.barrier()
        times["load"].append(time.perf_counter() - t)
        plain = Path(root) / f"plain{rank}.pt"
        t = time.perf_counter()
        torch.save(mine, plain)
        with open(plain, "rb+") as f:  # the same durability as the checkpoint's fsync
            os.fsync(f.fileno())
        dist.barrier()
        times["torch.save"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.load(plain, weights_only=True)
        dist.barrier()
        times["torch.load"].append(time.perf_counter() - t)
    ckpt_bytes = sum(p.stat().st_size for p in (Path(root) / "zt" / f"r{repeats - 1}").iterdir())
    plain_bytes = sum(p.stat().st_size for p in Path(root).glob("plain*.pt"))
    return {
        "times": {k: statistics.median(v) for k, v in times.items()},
        "ckpt_bytes": ckpt_bytes,
        "plain_bytes": plain_bytes,
    }


def _consolidate_rss(ckpt: Path, out: Path) -> tuple[float, float]:
    """Seconds and peak RSS (bytes) of ``zerotrain consolidate`` in a child process."""
    code = (
        "import resource, sys, time; from zerotrain.cli.main import main; t = time.perf_counter();"
        f"rc = main(['consolidate', {str(ckpt)!r}, {str(out)!r}]);"
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, rss = done.stdout.split()[-2:]
    return float(seconds), float(rss)


def _baseline_rss() -> float:
    """Peak RSS of a child that only imports zerotrain (torch itself)."""
    code = (
        "import resource, zerotrain.cli.main;"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    return float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (params + Adam)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    # 12 bytes per parameter: fp32 value and two Adam moments.
    width = int((args.gb * 1e9 / 12 / args.layers) ** 0.5)
    root = Path(args.dir or tempfile.mkdtemp(prefix="zt-ckpt-bench-"))
    try:
        result = run_distributed(
            _worker, 2, width, args.layers, str(root), args.repeats, timeout=1800
        )
        r = result[0]
        t = r["times"]
        gb, plain_gb = r["ckpt_bytes"] / 1e9, r["plain_bytes"] / 1e9
        seconds, rss = _consolidate_rss(root / "zt", root / "full.safetensors")
        base = _baseline_rss()
        largest = width * width * 4
        model_bytes = largest * args.layers
        rows = {
            "params": width * width * args.layers,
            "checkpoint_GB": round(gb, 3),
            "zerotrain_save_GBps": round(gb / t["save"], 2),
            "torch_save_GBps": round(plain_gb / t["torch.save"], 2),
            "zerotrain_load_GBps": round(gb / t["load"], 2),
            "torch_load_GBps": round(plain_gb / t["torch.load"], 2),
            "consolidate_s": round(seconds, 2),
            "consolidate_peak_rss_MiB": round(rss / 2**20, 1),
            "import_only_rss_MiB": round(base / 2**20, 1),
            "largest_param_MiB": round(largest / 2**20, 1),
            "model_fp32_MiB": round(model_bytes / 2**20, 1),
            "rss_above_import_in_largest_params": round((rss - base) / largest, 2),
        }
        print(json.dumps(rows, indent=1))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""ZeRO stages 0-3 across two hosts joined by a slow link (issue 27).

    OMP_NUM_THREADS=1 python benchmarks/multinode_link.py --json /tmp/zt/link.json   # root

Two hosts (network namespaces on one switch, ``zerotrain.testing.netns``), one rank each,
the demo GPT (``GPTConfig()``, fp32, AdamW), micro-batch 8 of 64 tokens. For each stage the
job runs ``--steps`` steps over a link throttled to ``--rate`` (``tc tbf`` both ways) and
the same over an unthrottled link; per step (median over the steps after the first):
seconds, the bytes zerotrain's collectives moved (``comm_stats()``: payload per rank) and
the bytes the link carried each way (the interface's own counters). The link's use: the
busier direction's bytes at the rate, as a fraction of the throttled step ("of the step":
the rest is compute and latency), and of the time the throttle added (throttled minus
unthrottled seconds; above 1 where transfers overlap compute or the token bucket's burst
lets the first 128 KiB through at full speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def _bits_per_second(rate: str) -> float:
    for unit, scale in RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use a number with kbit, mbit or gbit")


def _link(iface: str) -> tuple[int, int]:
    stats = Path(f"/sys/class/net/{iface}/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _train(stage: int, steps: int) -> dict[str, Any]:
    """Runs on every rank: ``steps`` steps of the demo GPT at ``stage``; per step seconds,
    counted bytes and the link's bytes each way."""
    import os

    import torch.distributed as dist

    import zerotrain
    from zerotrain.examples.gpt import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    micro = 8
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_batch_size": micro * world,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        },
    )
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    gen = torch.Generator().manual_seed(rank)
    rows: dict[str, list[float]] = {"seconds": [], "counted": [], "tx": [], "rx": []}
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (micro, cfg.block_size), generator=gen)
        counted, (tx, rx) = engine.comm_stats().total.bytes, _link(iface)
        start = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        rows["seconds"].append(time.perf_counter() - start)
        rows["counted"].append(engine.comm_stats().total.bytes - counted)
        now_tx, now_rx = _link(iface)
        rows["tx"].append(now_tx - tx)
        rows["rx"].append(now_rx - rx)
    params = sum(p.numel() for p in model.parameters())
    engine.destroy()
    return {"params": params, **rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    from zerotrain.testing import netns

    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"multinode link benchmark skipped: {reason}")
    # The hosts' processes import this file by name (it is on their path), not as __main__.
    sys.path.insert(0, str(Path(__file__).parent))
    from multinode_link import _train as train

    rate = _bits_per_second(args.rate)
    results: dict[str, Any] = {"rate": args.rate, "steps": args.steps, "stages": {}}
    for stage in (int(s) for s in args.stages.split(",")):
        row: dict[str, Any] = {}
        for kind, link_rate in (("throttled", args.rate), ("unthrottled", None)):
            with netns.hosts(2, rate=link_rate) as pair:
                ranks = netns.run_on_hosts(train, pair, stage, args.steps, timeout=1800)
            mine = ranks[0]
            row["params"] = mine["params"]
            row[kind] = {
                key: statistics.median(mine[key][1:]) for key in ("seconds", "counted", "tx", "rx")
            }
        added = row["throttled"]["seconds"] - row["unthrottled"]["seconds"]
        busiest = max(row["throttled"]["tx"], row["throttled"]["rx"])
        row["link_use_of_step"] = busiest * 8 / row["throttled"]["seconds"] / rate
        row["link_use"] = busiest * 8 / added / rate if added > 0 else None
        row["wire_over_counted"] = busiest / row["throttled"]["counted"]
        results["stages"][stage] = row
        t = row["throttled"]
        print(
            f"stage {stage}: {t['seconds']:.3f} s/step at {args.rate} "
            f"({row['unthrottled']['seconds']:.3f} unthrottled), counted "
            f"{t['counted'] / 1e6:.2f} MB, link tx {t['tx'] / 1e6:.2f} rx {t['rx'] / 1e6:.2f} "
            f"MB/step, link busy {row['link_use_of_step']:.2f} of the step, "
            f"{row['link_use'] or float('nan'):.2f} of the added time",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

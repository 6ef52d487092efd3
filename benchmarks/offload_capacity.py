"""Capacity: the largest GPT that trains 3 steps on this machine, per system, found by search.

Systems (2 CPU ranks over gloo, fp32, AdamW, micro-batch 1 x 32 tokens):

- ``ddp``: PyTorch DistributedDataParallel (every rank holds the whole model and optimizer);
- ``zerotrain-3``: zerotrain stage 3, model built under ``zerotrain.zero.Init``;
- ``zerotrain-3-nvme``: the same with ``offload_optimizer`` and ``offload_param`` on NVMe
  (swap files under ``--nvme-path``);
- ``deepspeed-3-nvme``: DeepSpeed stage 3 with the same offload, built under
  ``deepspeed.zero.Init`` (needs its async I/O op, which needs libaio-dev), in the
  configuration of it that trains: its default ``max_in_cpu`` (parameter shards of models
  under 1e9 elements per rank stay in memory; 0 fails, see ``_worker``), parameter buffers
  the size of the largest parameter, ``sub_group_size`` 1e8 (``--ds-*`` options).
  Build its ops once beforehand (``CPUAdamBuilder().load()``, ``AsyncIOBuilder().load()``):
  two ranks compiling at once wait on one lock, and a run killed while compiling leaves the
  lock behind (``~/.cache/torch_extensions/*/lock``).

A size fits when all 3 steps finish with finite losses while the resident memory of all
ranks together stays under ``--budget`` (a watchdog samples it and stops the run when it
goes over; each rank also reports its own peak, ``ru_maxrss``). The search grows the
number of layers (width ``--width``) geometrically until a size fails, then bisects.
Disk: bytes in the swap directory at its fullest.

    OMP_NUM_THREADS=1 python benchmarks/offload_capacity.py --systems zerotrain-3-nvme \
        --nvme-path /tmp/zt-swap --start-layers 70 --max-tries 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SEQ = 32
GiB = 1 << 30


def _params(layers: int, width: int) -> int:
    # Blocks (attention 4 w^2, MLP 8 w^2), 2 norms each, the byte embedding (tied head),
    # positions and the final norm; no biases.
    return layers * (12 * width * width + 2 * width) + 256 * width + SEQ * width + width


# -- one rank -------------------------------------------------------------------------------------


def _gpt_config(layers: int, width: int) -> Any:
    from zerotrain.examples.gpt import GPTConfig

    return GPTConfig(block_size=SEQ, n_layer=layers, n_head=16, n_embd=width, bias=False)


def _batch(step: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (1, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _zero_config(nvme_path: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 1,
        "reduce_bucket_size": 1,
    }
    if nvme_path:
        # Few buffers: resident memory is what is measured.
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 3}
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "max_in_cpu": 0,
            "buffer_count": 3,
        }
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    system = args.system
    nvme = args.nvme_path if system.endswith("-nvme") else None
    cfg = _gpt_config(args.layers, args.width)
    from zerotrain.examples.gpt import GPT

    built = time.perf_counter()
    if system == "ddp":
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

        def train_step(x: Any, y: Any) -> float:
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    elif system.startswith("zerotrain"):
        import zerotrain

        config = _zero_config(nvme)
        with zerotrain.zero.Init(config=config):
            torch.manual_seed(0)
            net = GPT(cfg)
        engine, *_ = zerotrain.initialize(model=net, config=config)

        def train_step(x: Any, y: Any) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return float(loss.detach())

    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        config = _zero_config(nvme)
        zero = config["zero_optimization"]
        zero["offload_optimizer"]["pin_memory"] = False
        # DeepSpeed 0.19 with max_in_cpu 0 (every parameter shard on NVMe) fails in the second
        # step at any size with more swappable parameters than param buffers ("Not enough
        # buffers 0 for swapping 1", deepspeedai/DeepSpeed#3062): the swapper does not give its
        # buffers back. Its default max_in_cpu keeps up to 1e9 elements of parameter shards per
        # rank in RAM instead; that is the configuration that trains, so it is the one measured.
        zero["offload_param"]["max_in_cpu"] = args.ds_max_in_cpu
        zero["offload_param"]["buffer_count"] = args.ds_param_buffers
        # Its parameter buffers default to 1e8 elements each; the largest parameter (the MLP's
        # 4 w x w) is all one needs to hold.
        zero["offload_param"]["buffer_size"] = 4 * args.width * args.width
        zero["offload_optimizer"]["buffer_count"] = 4
        # The optimizer swapper's buffers are sized by the largest sub-group (default 1e9
        # elements); smaller sub-groups keep them bounded.
        zero["sub_group_size"] = args.ds_sub_group_size
        with deepspeed.zero.Init(config_dict_or_path=config):
            torch.manual_seed(0)
            net = GPT(cfg)
        ds_engine, *_ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=config
        )

        def train_step(x: Any, y: Any) -> float:
            loss = ds_engine(x, y)
            ds_engine.backward(loss)
            ds_engine.step()
            return float(loss.detach())

    built = time.perf_counter() - built
    times, losses, rss = [], [], []
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = _batch(step)
        losses.append(train_step(x, y))
        times.append(time.perf_counter() - started)
        rss.append(_rss([os.getpid()]))  # resident memory after each step: flat or growing
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out).write_text(
        json.dumps(
            {"losses": losses, "times": times, "build_s": built, "peak_rss": peak, "rss": rss},
        )
    )
    if system.startswith("zerotrain"):
        engine.destroy(restore_params=False)  # the whole model would not fit on each rank


# -- the search -----------------------------------------------------------------------------------


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _disk(path: str | None) -> int:
    if not path or not os.path.isdir(path):
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while walking
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def attempt(system: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``layers`` layers with ``system`` on 2 ranks; what happened."""
    out_dir = Path(args.work) / f"{system}-{layers}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    nvme = args.nvme_path if system.endswith("-nvme") else None
    if nvme:
        shutil.rmtree(nvme, ignore_errors=True)
        os.makedirs(nvme)
    port = _free_port()
    procs = []
    for rank in range(args.world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(args.threads),
            "DS_ACCELERATOR": "cpu",
        }
        cmd = [sys.executable, __file__, "--worker", "--system", system]
        cmd += ["--layers", str(layers), "--width", str(args.width), "--steps", str(args.steps)]
        cmd += ["--out", str(out_dir / f"rank{rank}.json"), "--nvme-path", str(nvme or "")]
        cmd += ["--ds-param-buffers", str(args.ds_param_buffers)]
        cmd += ["--ds-max-in-cpu", str(args.ds_max_in_cpu)]
        cmd += ["--ds-sub-group-size", str(args.ds_sub_group_size)]
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True), log)
        )
    pids = [p.pid for p, _ in procs]
    started = time.monotonic()
    peak_sampled = peak_disk = 0
    verdict = None
    while any(p.poll() is None for p, _ in procs):
        rss = _rss(pids)
        peak_sampled = max(peak_sampled, rss)
        peak_disk = max(peak_disk, _disk(nvme))
        if rss > args.budget * GiB:
            verdict = f"over the {args.budget} GiB budget ({rss / GiB:.1f} GiB)"
        elif time.monotonic() - started > args.timeout:
            verdict = f"timed out after {args.timeout} s"
        elif any(p.poll() not in (None, 0) for p, _ in procs):
            verdict = "a rank failed"
        if verdict:
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    for p, log in procs:
        p.wait()
        log.close()
    results = []
    for rank in range(args.world):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    record: dict[str, Any] = {
        "system": system,
        "layers": layers,
        "params": _params(layers, args.width),
        "peak_rss_sampled": peak_sampled,
        "disk_bytes": peak_disk,
        "seconds": time.monotonic() - started,
    }
    if verdict is None and all(r is not None for r in results):
        import math

        losses = results[0]["losses"]
        if all(math.isfinite(v) for v in losses):
            record.update(
                fits=True,
                peak_rss=sum(r["peak_rss"] for r in results),
                step_s=results[0]["times"][1:] or results[0]["times"],
                build_s=results[0]["build_s"],
                losses=losses,
                rss_after_step=[sum(s) for s in zip(*(r["rss"] for r in results), strict=True)],
            )
            return record
        verdict = f"non-finite losses {losses}"
    if verdict is None:
        verdict = "a rank failed"
    tail = (out_dir / "rank0.log").read_text()[-1500:]
    record.update(fits=False, why=verdict, log_tail=tail)
    return record


def search(system: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Grow the layer count by ``--growth`` until a size fails, then bisect."""
    tried: list[dict[str, Any]] = []
    good, bad = 0, None
    layers = args.start_layers
    for _ in range(args.max_tries):
        record = attempt(system, layers, args)
        tried.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "log_tail"}), flush=True)
        if not record["fits"]:
            print(record.get("log_tail", ""), flush=True)
        if record["fits"]:
            good = max(good, layers)
        else:
            bad = layers if bad is None else min(bad, layers)
        if bad is None:
            layers = max(layers + 1, int(layers * args.growth))
        else:
            if bad - good <= max(1, args.resolution):
                break
            layers = (good + bad) // 2
    return tried


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="ddp,zerotrain-3,zerotrain-3-nvme")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--start-layers", type=int, default=8)
    parser.add_argument("--growth", type=float, default=1.5)
    parser.add_argument("--resolution", type=int, default=1, help="stop bisecting at this gap")
    parser.add_argument("--max-tries", type=int, default=6)
    parser.add_argument("--budget", type=float, default=20.0, help="GiB, all ranks together")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per attempt")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default="/tmp/zerotrain-capacity-swap")
    parser.add_argument("--work", default="/tmp/zerotrain-capacity")
    parser.add_argument("--json", help="write every attempt here")
    parser.add_argument(
        "--ds-param-buffers", type=int, default=5, help="DeepSpeed offload_param.buffer_count"
    )
    parser.add_argument(
        "--ds-max-in-cpu", type=int, default=10**9, help="DeepSpeed offload_param.max_in_cpu"
    )
    parser.add_argument(
        "--ds-sub-group-size", type=int, default=10**8, help="DeepSpeed zero sub_group_size"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    everything = []
    for system in args.systems.split(","):
        everything += search(system, args)
    print(
        "\n| system | largest that trains (params) | layers | peak RSS, all ranks (GiB) "
        "| disk (GB) | s/step |"
    )
    print("|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        fits = [r for r in everything if r["system"] == system and r["fits"]]
        if not fits:
            print(f"| {system} | none of the sizes tried | | | | |")
            continue
        best = max(fits, key=lambda r: r["params"])
        step = sum(best["step_s"]) / len(best["step_s"])
        print(
            f"| {system} | {best['params'] / 1e9:.2f}B | {best['layers']} | "
            f"{best['peak_rss'] / GiB:.1f} | {best['disk_bytes'] / 1e9:.1f} | {step:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()

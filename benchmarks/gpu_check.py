"""The GPU checklist of ``../shared/GPU.md`` as one script: parity, engine overhead, MFU,
offload throughput, each case in its own process so one failure does not hide the others.

Run on a machine with one CUDA GPU (world size 1; every case sets its own rendezvous)::

    python benchmarks/gpu_check.py all --out /tmp/gpu

``all`` runs, in order of importance, and writes ``results.json`` and ``summary.md``:

* ``parity``: the demo GPT in fp32 at ZeRO stages 0-3 against a plain PyTorch loop (same
  initial weights and batches, torch AdamW, clipping active): losses over 12 steps.
* ``overhead``: a ~350M-parameter demo GPT (28 blocks of width 1024, sequence 1024, bf16)
  in zerotrain at stages 0-3 against a hand-written loop doing the same arithmetic with
  torch's fused AdamW: bf16 weights stepped through fp32 master copies (zerotrain's ``bf16``),
  and fp32 weights under ``torch.autocast`` (zerotrain's ``torch_autocast``). Median of 5
  windows of 5 steps each, after warm-up; tokens/s, peak memory and MFU (FLOPs of one
  step counted by PyTorch's ``FlopCounterMode``, which the flops profiler reads, over the
  step time and the GPU's dense bf16 peak).
* ``offload``: a ~1.3B model at stage 2 with ``offload_optimizer: cpu``.

Each engine case also runs one steady step under ``torch.cuda.set_sync_debug_mode("error")``
(``sync_free``: True, or the first line of the error naming the synchronizing call).

``case states <stage> --size 350m``: ``engine.offload_states()`` / ``reload_states()``
on that model (memory, time of each call, losses after the round trip).

Diagnostics: ``--cases`` picks the throughput cases (an engine case with ``_noadopt`` or
``_nocheck`` in its name leaves out a part of the step, see ``_ablate``), ``--profile``
writes profiler tables of the named cases. ``--size tiny`` shrinks every model so the script
can be tried on a CPU. Results: ``benchmarks/RESULTS.md`` (2026-11-27).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerotrain.examples.gpt import GPT, GPTConfig

# Dense bf16 tensor-core peak (SXM parts), TFLOP/s: the denominator of MFU.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}

PARITY_CFG = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128)
PARITY = {"batch": 8, "steps": 12, "lr": 1e-3, "wd": 0.01, "clip": 0.05}

SIZES: dict[str, dict[str, Any]] = {
    # ~352M parameters: 28 blocks x 12.6M plus embeddings.
    "350m": {"cfg": GPTConfig(block_size=1024, n_layer=28, n_head=16, n_embd=1024), "batch": 8},
    "1b3": {"cfg": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=2048), "batch": 4},
    "tiny": {"cfg": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64), "batch": 2},
}
OVERHEAD_CASES = [
    "hand_master",
    "engine_bf16_s0",
    "hand_autocast",
    "engine_autocast_s0",
    "engine_bf16_s1",
    "engine_bf16_s2",
    "engine_bf16_s3",
]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def world_of_one() -> None:
    """The environment of a one-rank job, as torchrun would set it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def engine_config(stage: int, batch: int, lr: float, wd: float, clip: float) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
        "zero_optimization": {"stage": stage},
    }


def batches(cfg: GPTConfig, batch: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append((ids[:, :-1].to(device()), ids[:, 1:].to(device())))
    return out


# ---------------------------------------------------------------- parity


def case_parity(stage: int) -> dict[str, Any]:
    import zerotrain

    torch.manual_seed(0)
    model = GPT(PARITY_CFG)
    reference = copy.deepcopy(model).to(device())
    data = batches(PARITY_CFG, PARITY["batch"], PARITY["steps"], seed=1)
    # A loss spike in the middle: one step on a batch of a single repeated token.
    spike = torch.full_like(data[6][0], 7)
    data[6] = (spike, spike)

    opt = torch.optim.AdamW(reference.parameters(), lr=PARITY["lr"], weight_decay=PARITY["wd"])
    ref_losses = []
    for x, y in data:
        loss = reference(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), PARITY["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())

    config = engine_config(stage, PARITY["batch"], PARITY["lr"], PARITY["wd"], PARITY["clip"])
    engine, *_ = zerotrain.initialize(model=model, config=config)
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    return {
        "stage": stage,
        "device": str(engine.device),
        "losses": losses,
        "reference": ref_losses,
        "max_abs_diff": worst,
        "ok": worst <= 1e-5,
    }


# ---------------------------------------------------------------- overhead


def count_step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one forward and backward, as ``FlopCounterMode`` (the profiler's source)
    counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def hand_master_step(model: torch.nn.Module, lr: float, clip: float) -> Callable[..., float]:
    """bf16 weights, fp32 master copies stepped by torch's fused AdamW: zerotrain's ``bf16``
    arithmetic written by hand."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(False) for p in params]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01, fused=device().type == "cuda")

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model(x, y)
        loss.backward()
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, clip, foreach=True)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        for m in masters:
            m.grad = None
        return loss.detach()

    return step


def hand_autocast_step(model: torch.nn.Module, lr: float, clip: float) -> Callable[..., float]:
    """fp32 weights, forward under ``torch.autocast(bf16)``, fused AdamW."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.01, fused=device().type == "cuda"
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast(device().type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _ablate(name: str, config: dict[str, Any]) -> None:
    """Diagnostic variants of an engine case, to attribute its overhead: ``_noadopt`` skips
    the per-step comparison that takes parameter writes made outside the optimizer into the
    fp32 master; ``_nocheck`` skips the non-finite gradient check (its device sync)."""
    if "_noadopt" in name:
        from zerotrain.zero.strategy import ZeroStrategy

        ZeroStrategy.adopt_outside_changes = lambda self: None  # type: ignore[method-assign]
    if "_nocheck" in name:
        config["non_finite_gradients"] = {"action": "ignore"}


def profile_steps(step: Callable[..., Any], data: list[Any], path: Path) -> dict[str, Any]:
    """Three steps under the profiler: tables by device and by host time (their totals say
    how busy each was) and kernel launches per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(3):
            step(*data[i % len(data)])
        sync()
        wall = time.perf_counter() - start
    table = prof.key_averages()
    launches = sum(e.count for e in table if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    text = [f"wall {wall * 1e3:.1f} ms for 3 steps", ""]
    if torch.cuda.is_available():
        text.append(table.table(sort_by="self_device_time_total", row_limit=30))
    text.append(table.table(sort_by="self_cpu_time_total", row_limit=30))
    path.write_text("\n".join(text))
    return {"profile_wall_ms": wall * 1e3, "launches_per_step": launches / 3}


def case_throughput(name: str, size: str, profile_dir: Path | None = None) -> dict[str, Any]:
    import re

    import zerotrain

    spec = SIZES[size]
    cfg, batch = spec["cfg"], spec["batch"]
    lr, clip = 1e-4, 1.0
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    data = batches(cfg, batch, 4, seed=2)
    flops = None
    if name == "hand_master":
        model = model.to(device(), torch.bfloat16)
        flops = count_step_flops(model, *data[0])
        step = hand_master_step(model, lr, clip)
    elif name == "hand_autocast":
        model = model.to(device())
        step = hand_autocast_step(model, lr, clip)
    else:
        found = re.search(r"_s(\d)", name)
        assert found, name
        config = engine_config(int(found.group(1)), batch, lr, 0.01, clip)
        _ablate(name, config)
        if "autocast" in name:
            config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        else:
            config["bf16"] = {"enabled": True}
        if "offload" in name:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine, *_ = zerotrain.initialize(model=model, config=config)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

    warmup, windows, per_window = (2, 3, 2) if "offload" in name else (3, 5, 5)
    for i in range(warmup):
        step(*data[i % len(data)])
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    last = None
    for _ in range(windows):
        sync()
        start = time.perf_counter()
        for i in range(per_window):
            last = step(*data[i % len(data)])
        sync()
        times.append((time.perf_counter() - start) / per_window)
    step_s = statistics.median(times)
    tokens = batch * cfg.block_size
    # Issue 43: a steady step makes the host wait for the device nowhere (no .item(), no
    # blocking copy); CUDA's sync debug mode turns any such call into an error.
    sync_free: bool | str | None = None
    if torch.cuda.is_available() and name.startswith("engine"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(*data[0])
            sync_free = True
        except RuntimeError as exc:
            sync_free = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    profiled = {}
    if profile_dir is not None:
        profiled = profile_steps(step, data, profile_dir / f"profile_{name}.txt")
    return {
        **profiled,
        "case": name,
        "size": size,
        "params": n_params,
        "step_s": step_s,
        "window_step_s": times,
        "tokens_per_s": tokens / step_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
        "step_flops": flops,
        "last_loss": float(last) if last is not None else None,
        "sync_free": sync_free,
    }


# ---------------------------------------------------------------- offload_states


def case_offload_states(stage: int, size: str) -> dict[str, Any]:
    """``engine.offload_states()`` / ``reload_states()`` on the GPU-sized GPT (bf16): device
    memory before, while offloaded and after; the time of each call (pinned, blocking); and
    the losses of the steps after the round trip against the same run without it."""
    import zerotrain

    spec = SIZES[size]
    cfg, batch = spec["cfg"], spec["batch"]
    data = batches(cfg, batch, 4, seed=3)

    def run(offload: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        config = engine_config(stage, batch, 1e-4, 0.01, 1.0)
        config["bf16"] = {"enabled": True}
        engine, *_ = zerotrain.initialize(model=GPT(cfg), config=config)
        sync()
        losses, seen = [], {"built_gib": torch.cuda.memory_allocated() / 2**30}
        for i, (x, y) in enumerate(data):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            if offload and i in (1, 2):  # twice: the second offload reuses nothing
                sync()
                seen.setdefault("before_gib", []).append(torch.cuda.memory_allocated() / 2**30)
                start = time.perf_counter()
                engine.offload_states(pin_memory=True)
                sync()
                seen.setdefault("offload_s", []).append(time.perf_counter() - start)
                seen.setdefault("during_gib", []).append(torch.cuda.memory_allocated() / 2**30)
                start = time.perf_counter()
                engine.reload_states()
                sync()
                seen.setdefault("reload_s", []).append(time.perf_counter() - start)
                seen.setdefault("after_gib", []).append(torch.cuda.memory_allocated() / 2**30)
        engine.destroy()
        return {"losses": losses, **seen}

    moved = run(True)  # first: nothing of another run is left in memory
    plain = run(False)
    return {
        "case": f"offload_states_s{stage}",
        **{k: v for k, v in moved.items() if k != "losses"},
        "losses": moved["losses"],
        "losses_without": plain["losses"],
        "identical": moved["losses"] == plain["losses"],
    }


# ---------------------------------------------------------------- driver


def run_case(args: list[str], timeout: float) -> dict[str, Any]:
    """One case in a fresh process; its JSON result, or what went wrong."""
    cmd = [sys.executable, __file__, "case", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"args": args, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"args": args, "error": f"rc {done.returncode}", "stderr": done.stderr[-3000:]}
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = time.perf_counter() - start
    return result


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def peak_tflops() -> float | None:
    name = gpu_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def summarize(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}, torch {results['torch']}", ""]
    lines += ["| parity stage | max abs loss diff | ok |", "| --- | --- | --- |"]
    for r in results["parity"]:
        if "error" in r:
            lines.append(f"| {r['args']} | error: {r['error']} | no |")
        else:
            lines.append(f"| {r['stage']} | {r['max_abs_diff']:.2e} | {r['ok']} |")
    over = {r.get("case"): r for r in results["overhead"] if "error" not in r}
    flops = over.get("hand_master", {}).get("step_flops")
    peak = peak_tflops()
    head = "| case | step ms | tokens/s | vs hand | peak GiB | MFU | no host sync |"
    lines += ["", head, "| --- " * 7 + "|"]
    for r in results["overhead"] + results["offload"]:
        if "error" in r:
            lines.append(f"| {r['args']} | error: {r['error']} | | | | | |")
            continue
        base_name = "hand_autocast" if "autocast" in r["case"] else "hand_master"
        base = over.get(base_name)
        ratio = f"{r['step_s'] / base['step_s']:.3f}" if base and "offload" not in r["case"] else ""
        mfu = f"{flops / r['step_s'] / (peak * 1e12):.3f}" if flops and peak else ""
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else ""
        lines.append(
            f"| {r['case']} ({r['params'] / 1e6:.0f}M) | {r['step_s'] * 1e3:.1f} | "
            f"{r['tokens_per_s']:.0f} | {ratio} | {mem} | {mfu} | {r.get('sync_free', '')} |"
        )
    if flops:
        lines.append(f"\nFLOPs per step (FlopCounterMode, forward+backward): {flops:.4g}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    every = sub.add_parser("all")
    every.add_argument("--out", type=Path, required=True)
    every.add_argument("--size", default="350m", choices=["350m", "tiny"])
    every.add_argument("--offload-size", default="1b3", choices=["1b3", "tiny"])
    every.add_argument("--skip-offload", action="store_true")
    every.add_argument("--skip-parity", action="store_true")
    every.add_argument(
        "--cases", default=",".join(OVERHEAD_CASES), help="comma-separated overhead cases"
    )
    every.add_argument("--profile", default="", help="comma-separated cases to profile too")
    one = sub.add_parser("case")
    one.add_argument("kind", choices=["parity", "throughput", "states"])
    one.add_argument("name")
    one.add_argument("--size", default="350m")
    one.add_argument("--profile-dir", type=Path)
    args = parser.parse_args()

    if args.cmd == "case":
        world_of_one()
        if args.kind == "parity":
            result = case_parity(int(args.name))
        elif args.kind == "states":
            result = case_offload_states(int(args.name), args.size)
        else:
            result = case_throughput(args.name, args.size, args.profile_dir)
        print("RESULT " + json.dumps(result), flush=True)
        return

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": gpu_name(),
        "torch": torch.__version__,
        "parity": [],
        "overhead": [],
        "offload": [],
    }

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "summary.md").write_text(summarize(results))

    for stage in range(0 if args.skip_parity else 4):
        results["parity"].append(run_case(["parity", str(stage)], timeout=120))
        print(json.dumps(results["parity"][-1])[:400], flush=True)
        save()
    profiled = set(filter(None, args.profile.split(",")))
    for name in filter(None, args.cases.split(",")):
        extra = ["--profile-dir", str(args.out)] if name in profiled else []
        case = ["throughput", name, "--size", args.size, *extra]
        results["overhead"].append(run_case(case, 180))
        print(json.dumps(results["overhead"][-1])[:400], flush=True)
        save()
    if not args.skip_offload:
        name = "engine_bf16_offload_s2"
        results["offload"].append(
            run_case(["throughput", name, "--size", args.offload_size], timeout=240)
        )
        print(json.dumps(results["offload"][-1])[:400], flush=True)
        save()
    print(summarize(results), flush=True)


if __name__ == "__main__":
    main()

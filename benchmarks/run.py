"""Run zerotrain and its peers side by side and write a results table.

    python benchmarks/run.py --size small --world-sizes 2 \
        --systems ddp,zerotrain-0,zero1torch,fsdp2,deepspeed-0 --steps 20

Each system trains the same GPT on the same data with the same optimizer (AdamW, fused
where torch has it), gradient clipping 1.0 and micro-batch, on CPU ranks (gloo), for each
of ``--world-sizes``. A system name ending in ``-bf16`` (``zerotrain-3-bf16``,
``fsdp2-bf16``, ``ddp-bf16``, ``deepspeed-2-bf16``) trains with bf16 mixed precision, each
system its own way; the others in fp32. Systems run one after another, ``--repeats`` times
in interleaved order, and the median step time is reported, so a system is not favoured by
when it ran.
Results are printed as markdown tables and, with ``--results``, appended to a file with
the command. DeepSpeed is skipped (with a note) when it is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def run_system(system: str, world: int, args: argparse.Namespace, out: Path) -> list[dict] | str:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(WORKER),
        "--system",
        system,
        "--size",
        args.size,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        str(out),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout}s"
    files = sorted(out.glob(f"{system}.rank*.json"))
    if len(files) != world:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        return f"failed (exit {proc.returncode}): " + " | ".join(tail)
    results = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    return results


def summarize(system: str, runs: list[list[dict]]) -> dict:
    times = [max(r["elapsed"] for r in ranks) / ranks[0]["steps"] for ranks in runs]
    first = runs[0][0]
    step_time = statistics.median(times)
    all_ranks = [r for ranks in runs for r in ranks]
    return {
        "system": system,
        "params": first["params"],
        "step_time": step_time,
        "tokens_per_s": first["tokens_per_step"] / step_time,
        "peak_rss": max(r["peak_rss"] for r in all_ranks),
        "rss_growth": max(r["peak_rss"] - r["baseline_rss"] for r in all_ranks),
        "state": max(sum(r["state"].values()) for r in all_ranks),
        "state_parts": runs[0][0]["state"],
        "comm": first["comm_per_step"],
        "final_loss": statistics.mean(r["losses"][-1] for r in runs[0]),
    }


def table(rows: list[dict], baseline: str) -> str:
    base = next((r for r in rows if r["system"] == baseline), None)
    lines = [
        "| system | tokens/s | vs " + baseline + " | step ms | peak RSS/rank MiB | RSS growth MiB "
        "| model states/rank MiB (params+grads+optim) | comm/step MiB (paper volume) | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
        parts = r["state_parts"]
        state = (
            f"{_mib(r['state'])} ({_mib(parts['params'])}+{_mib(parts['grads'])}"
            f"+{_mib(parts['optimizer'])})"
        )
        comm = "n/a" if r["comm"] is None else _mib(r["comm"])
        lines.append(
            f"| {r['system']} | {r['tokens_per_s']:,.0f} | {ratio} | {1000 * r['step_time']:.1f} "
            f"| {_mib(r['peak_rss'])} | {_mib(r['rss_growth'])} | {state} | {comm} "
            f"| {r['final_loss']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="ddp,zerotrain-0,zero1torch,fsdp2,deepspeed-0")
    parser.add_argument("--size", default="small", choices=["small", "medium"])
    parser.add_argument("--world-sizes", default="2", help="comma list; one table each")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--results", help="append the table to this markdown file")
    args = parser.parse_args()

    systems = args.systems.split(",")
    notes = []
    if any(s.startswith("deepspeed") for s in systems) and not importlib.util.find_spec(
        "deepspeed"
    ):
        notes.append("DeepSpeed is not installed; its rows are skipped.")
        systems = [s for s in systems if not s.startswith("deepspeed")]
    command = "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    reports = [f"`{command}`", ""]
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows = run_world(systems, world, args, notes)
        if rows:
            plural = "s" if world > 1 else ""
            reports += [
                f"#### {args.size} GPT ({rows[0]['params'] / 1e6:.1f}M parameters), "
                f"{world} rank{plural}",
                "",
                table(rows, systems[0]),
                "",
            ]
    report = "\n".join([*reports, *(f"- {n}" for n in notes)])
    print(report)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + report + "\n")


def run_world(
    systems: list[str], world: int, args: argparse.Namespace, notes: list[str]
) -> list[dict]:
    """Every system on ``world`` ranks, ``args.repeats`` times in interleaved order."""
    runs: dict[str, list[list[dict]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for system in systems:
                result = run_system(system, world, args, Path(tmp))
                if isinstance(result, str):
                    notes.append(f"{system} on {world} ranks (repeat {repeat + 1}): {result}")
                else:
                    runs[system].append(result)
                status = result if isinstance(result, str) else "ok"
                print(
                    f"[{world} ranks, {repeat + 1}/{args.repeats}] {system}: {status}", flush=True
                )
    return [summarize(s, r) for s, r in runs.items() if r]


if __name__ == "__main__":
    main()

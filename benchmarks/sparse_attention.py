"""Block-sparse attention (issue 25): speed, memory and the longest sequence, against dense.

    OMP_NUM_THREADS=1 python benchmarks/sparse_attention.py speed --json /tmp/zt/sa_speed.json
    OMP_NUM_THREADS=1 python benchmarks/sparse_attention.py memory --json /tmp/zt/sa_mem.json
    OMP_NUM_THREADS=1 python benchmarks/sparse_attention.py longest --json /tmp/zt/sa_long.json
    OMP_NUM_THREADS=1 python benchmarks/sparse_attention.py flex --json /tmp/zt/sa_flex.json
    python benchmarks/sparse_attention.py layouts --out docs/img

Every case: B=1, H=8, D=64, fp32, one CPU thread, forward + backward of ``out.sum()``. The
layout (``LAYOUT``) is BigBird, causal, block 32: one random block, a window of 3 blocks (the
diagonal and the one before it, causal) and one global block per row; its density (fraction
of the ``L x L`` matrix computed, after the causal cut) is printed per length, 3.0% at 4k.

* ``speed``: median of 5 at 4k and 16k, zerotrain's blocked kernel against dense causal SDPA
  (PyTorch's CPU flash kernel, which already skips the upper triangle).
* ``memory``: peak resident memory of one forward + backward above the inputs (and, for the
  sparse kernel, the layout and its block table, built once per length), each case in a
  fresh process; the sparse kernel, dense SDPA with an explicit boolean mask of the same
  pattern (the only way dense attention can apply it; it materialises ``L x L`` scores), and
  dense causal SDPA. The longest length that fits a memory budget follows from the measured
  growth (quadratic for the explicit mask, linear for the kernel).
* ``longest``: the longest sequence whose forward + backward finishes in 60 s, sparse and
  dense causal SDPA, each length run once in a fresh process, doubling then bisecting.
* ``flex``: inference (no gradients) at 4k, the blocked kernel against compiled
  FlexAttention with the same block mask (compile time reported separately).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from zerotrain.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention

B, H, D = 1, 8, 64
LAYOUT = {
    "block": 32,
    "num_random_blocks": 1,
    "num_sliding_window_blocks": 3,
    "num_global_blocks": 1,
    "attention": "unidirectional",
}
BUDGET_S = 60.0


def _attention(length: int, kernel: str = "blocked") -> SparseSelfAttention:
    cfg = BigBirdSparsityConfig(H, **LAYOUT)  # type: ignore[arg-type]
    return SparseSelfAttention(cfg, max_seq_length=length, kernel=kernel)


def _inputs(length: int, grad: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, length, D, generator=gen).requires_grad_(grad) for _ in range(3)]


def _step(impl: str, length: int) -> Callable[[], None]:
    q, k, v = _inputs(length)
    if impl == "sparse":
        attn = _attention(length)
        # The block table is built once per length and cached (its cost grows with the
        # square of the block count); it is set-up, not part of a training step.
        attn.block_table(length, q.device)
        fn: Callable[[], torch.Tensor] = lambda: attn(q, k, v)  # noqa: E731
    elif impl == "dense_causal":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif impl == "dense_masked":
        mask = _element_mask(length)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    else:
        raise ValueError(impl)

    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        fn().sum().backward()

    return run


def _element_mask(length: int) -> torch.Tensor:
    attn = _attention(length)
    nb = length // LAYOUT["block"]  # type: ignore[operator]
    layout = attn.master_layout[:, :nb, :nb]
    block = int(LAYOUT["block"])  # type: ignore[call-overload]
    mask = layout.repeat_interleave(block, 1).repeat_interleave(block, 2)
    return (mask & torch.ones(length, length, dtype=torch.bool).tril()).unsqueeze(0)


def _timed(run: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def speed(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    for length in args.lengths:
        density = _attention(length).density(length)
        sparse = _timed(_step("sparse", length), args.repeats)
        dense = _timed(_step("dense_causal", length), args.repeats)
        row = {
            "length": length,
            "density": density,
            "sparse_s": statistics.median(sparse),
            "dense_causal_s": statistics.median(dense),
            "speedup": statistics.median(dense) / statistics.median(sparse),
            "sparse_all": sparse,
            "dense_all": dense,
        }
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        rows.append(row)
    return {"speed": rows}


def _child(impl: str, length: int, repeats: int) -> dict[str, Any]:
    """One case in this (fresh) process: set-up time (inputs, layout and block table), then
    time and peak RSS above the set-up."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    run = _step(impl, length)
    setup = time.perf_counter() - start
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = _timed(run, repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "impl": impl,
        "length": length,
        "setup_s": setup,
        "seconds": times,
        "peak_above_inputs_mib": (peak - base) / 1024,
    }


def _in_child(impl: str, length: int, repeats: int = 1, timeout: float = 900) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "_child", impl, str(length), str(repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        return {"impl": impl, "length": length, "error": done.stderr[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def memory(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for impl, lengths in (
        ("sparse", args.sparse_lengths),
        ("dense_masked", args.masked_lengths),
        ("dense_causal", args.sparse_lengths),
    ):
        if impl not in args.impls:
            continue
        for length in lengths:
            row = _in_child(impl, length)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"memory": rows}


def longest(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl, start in (("sparse", args.sparse_start), ("dense_causal", args.dense_start)):
        tried: list[dict[str, Any]] = []

        def fits(length: int) -> bool:
            row = _in_child(impl, length, timeout=4 * BUDGET_S)  # noqa: B023
            row["fits"] = "error" not in row and row["seconds"][0] <= BUDGET_S
            print(json.dumps(row), flush=True)
            tried.append(row)  # noqa: B023
            return bool(row["fits"])

        good, bad = 0, start
        while fits(bad):
            good, bad = bad, 2 * bad
        # Bisect to a multiple of 4 blocks (128 tokens) between the last fit and first miss.
        while bad - good > max(1024, good // 16):
            mid = (good + bad) // 2 // 128 * 128
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        out[impl] = {"longest": good, "first_too_slow": bad, "tried": tried}
        print(json.dumps({impl: out[impl]["longest"]}), flush=True)
    out["ratio"] = out["sparse"]["longest"] / max(out["dense_causal"]["longest"], 1)
    return {"longest": out}


def _discard(_: object) -> None:
    return None


def flex(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    length = args.length
    q, k, v = _inputs(length, grad=False)
    blocked, compiled = _attention(length, "blocked"), _attention(length, "flex")
    with torch.no_grad():
        start = time.perf_counter()
        first = compiled(q, k, v)
        compile_s = time.perf_counter() - start
        diff = float((first - blocked(q, k, v)).abs().max())
        t_blocked = _timed(lambda: _discard(blocked(q, k, v)), args.repeats)
        t_flex = _timed(lambda: _discard(compiled(q, k, v)), args.repeats)
    row = {
        "length": length,
        "first_call_with_compile_s": compile_s,
        "blocked_s": statistics.median(t_blocked),
        "flex_s": statistics.median(t_flex),
        "max_abs_diff": diff,
    }
    print(json.dumps(row), flush=True)
    return {"flex": row}


LAYOUTS: dict[str, dict[str, Any]] = {
    "dense": {"mode": "dense"},
    "fixed": {"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 1},
    "variable": {
        "mode": "variable",
        "num_random_blocks": 1,
        "local_window_blocks": [2, 4],
        "global_block_indices": [0, 9],
        "global_block_end_indices": [1, 11],
    },
    "bigbird": {"mode": "bigbird", "num_random_blocks": 1},
    "bslongformer": {"mode": "bslongformer", "global_block_indices": [0, 16]},
    "local": {"mode": "local", "num_sliding_window_blocks": 5},
}


def layouts(args: argparse.Namespace) -> dict[str, Any]:
    """One PNG per mode: head 0's block mask at 32 x 32 blocks, both directions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zerotrain.sparse_attention import sparsity_config_from_dict

    args.out.mkdir(parents=True, exist_ok=True)
    written = {}
    for mode, section in LAYOUTS.items():
        fig, axes = plt.subplots(1, 2, figsize=(8, 4.3))
        for ax, attention in zip(axes, ("bidirectional", "unidirectional"), strict=True):
            keys = {**section, "block": 32}
            if mode != "dense":
                keys["attention"] = attention
            attn = SparseSelfAttention(
                sparsity_config_from_dict(keys, 1),
                max_seq_length=1024,
                causal=attention == "unidirectional",
            )
            table_density = attn.density(1024)
            ax.imshow(attn.master_layout[0].numpy(), cmap="Blues", vmin=0, vmax=1.3)
            ax.set_title(f"{attention}: {100 * table_density:.0f}% computed", fontsize=10)
            ax.set_xlabel("key block")
            ax.set_ylabel("query block")
        fig.suptitle(
            f"mode {mode!r}: {json.dumps({k: v for k, v in section.items() if k != 'mode'})}",
            fontsize=9,
        )
        fig.tight_layout()
        path = args.out / f"sparse_layout_{mode}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written[mode] = str(path)
    return {"layouts": written}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        impl, length, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(_child(impl, length, repeats)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("speed")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("memory")
    p.add_argument("--sparse-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 65536])
    p.add_argument("--masked-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument(
        "--impls",
        nargs="+",
        default=["sparse", "dense_masked", "dense_causal"],
        choices=["sparse", "dense_masked", "dense_causal"],
    )
    p = sub.add_parser("longest")
    p.add_argument("--sparse-start", type=int, default=65536)
    p.add_argument("--dense-start", type=int, default=16384)
    p = sub.add_parser("flex")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p = sub.add_parser("layouts")
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    for p in sub.choices.values():
        p.add_argument("--json", type=Path)
    args = parser.parse_args()
    run = {"speed": speed, "memory": memory, "longest": longest, "flex": flex, "layouts": layouts}
    result = run[args.what](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

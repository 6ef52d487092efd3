"""The main job: train a byte-level GPT on Python's own documentation with zerotrain.

Run it through the launcher (``zerotrain demo`` does this for you)::

    zerotrain run -n 2 -m zerotrain.examples.train_gpt --steps 300

Rank 0 shows a progress bar (loss, tokens/s, memory per rank) on a terminal, or plain lines
in a log, and at the end writes ``loss_curve.png`` and ``summary.txt`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import zerotrain
from zerotrain.engine.engine import Engine
from zerotrain.examples.corpus import ByteWindows, load_corpus, split
from zerotrain.examples.gpt import GPT, GPTConfig, generate, param_groups
from zerotrain.utils.memory import current_rss_bytes, format_bytes, peak_rss_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (default 3)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="bf16/fp16: mixed precision with fp32 master weights (fp16 with loss scaling)",
    )
    parser.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block in backward instead of storing its activations",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="demo_out")
    parser.add_argument(
        "--save-every", type=int, default=100, help="checkpoint every N steps (0: only at the end)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from OUT_DIR/checkpoints/latest"
    )
    return parser.parse_args(argv)


def _per_rank(engine: Engine, value: float) -> list[float]:
    """Every rank's ``value``, on every rank (one small collective)."""
    slots = [0.0] * engine.comm.world_size
    slots[engine.comm.rank] = value
    return engine.comm.all_reduce_floats(slots)


@torch.no_grad()
def _validation_loss(engine: Engine, data: bytes, block_size: int, batches: int = 8) -> float:
    engine.eval()
    windows = ByteWindows(data, block_size)
    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(batches):
        idx = torch.randint(0, len(windows), (16,), generator=gen).tolist()
        x = torch.stack([windows[i][0] for i in idx]).to(engine.device)
        y = torch.stack([windows[i][1] for i in idx]).to(engine.device)
        total += float(engine(x, y))
    engine.train()
    return sum(_per_rank(engine, total / batches)) / engine.comm.world_size


def _zero_projection(params: int, world: int) -> list[tuple[str, int]]:
    """Model-state bytes per rank for fp32 Adam (4 B params, 4 B grads, 8 B moments), as the
    ZeRO paper's formulas give them for each stage."""
    return [
        ("stage 0 (plain data parallel)", 16 * params),
        ("stage 1 (optimizer states)", 8 * params + 8 * params // world),
        ("stage 2 (+ gradients)", 4 * params + 12 * params // world),
        ("stage 3 (+ parameters)", 16 * params // world),
    ]


def _plot(losses: list[float], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'zerotrain[demo]'); no plot written"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("byte-level GPT on Python's documentation")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curve: {path}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(cfg)
    params = model.num_parameters()  # at stage 3 the model's own tensors are empty later
    train_bytes, val_bytes = split(load_corpus())
    dataset = ByteWindows(train_bytes, args.block_size, stride=args.block_size // 2)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95]}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": max(1, args.steps // 20),
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": args.precision == "fp16"},
        # The progress bar reports every step; the engine's own log only at the end.
        "steps_per_print": args.steps,
    }
    if args.checkpoint_activations:
        config["activation_checkpointing"] = {"block_types": "auto"}
    engine, _, loader, _ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), training_data=dataset, config=config
    )
    if loader is None:
        raise RuntimeError("initialize returned no DataLoader although training_data was given")
    rank0 = engine.comm.rank == 0
    tokens_per_step = engine.train_batch_size() * args.block_size
    checkpoints = Path(args.out_dir) / "checkpoints"
    losses: list[float] = []
    if args.resume:
        if (checkpoints / "latest").is_file():
            path, state = engine.load_checkpoint(checkpoints)
            losses = list(state["losses"]) if state else []
            if rank0:
                print(f"resumed from {path} at step {engine.global_steps}", flush=True)
        elif rank0:
            print(f"--resume: no checkpoint under {checkpoints}; starting fresh", flush=True)
    first_step = engine.global_steps
    bar = tqdm(
        total=args.steps,
        initial=first_step,
        disable=not (rank0 and sys.stderr.isatty()),
        unit="step",
    )
    rss = [0.0] * engine.comm.world_size
    window_loss, start = 0.0, time.perf_counter()
    while engine.global_steps < args.steps:
        for x, y in loader:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            window_loss += loss.item() / args.grad_accum
            if engine.micro_steps % args.grad_accum:
                continue
            losses.append(sum(_per_rank(engine, window_loss)) / engine.comm.world_size)
            window_loss = 0.0
            if engine.global_steps % 10 == 0 or engine.global_steps == 1:
                rss = _per_rank(engine, float(current_rss_bytes()))
            done = engine.global_steps - first_step
            tok_s = tokens_per_step * done / (time.perf_counter() - start)
            memory = " ".join(f"r{r}:{format_bytes(m)}" for r, m in enumerate(rss))
            bar.set_postfix_str(f"loss {losses[-1]:.3f} | {tok_s:,.0f} tok/s | {memory}")
            bar.update(1)
            if rank0 and bar.disable and engine.global_steps % max(1, args.steps // 10) == 0:
                print(
                    f"step {engine.global_steps}/{args.steps} loss {losses[-1]:.3f} "
                    f"{tok_s:,.0f} tok/s mem {memory}",
                    flush=True,
                )
            if args.save_every and engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(checkpoints, client_state={"losses": losses}, keep_last=2)
            if engine.global_steps >= args.steps:
                break
    bar.close()
    elapsed = time.perf_counter() - start
    if not (checkpoints / f"global_step{engine.global_steps}").is_dir():
        engine.save_checkpoint(checkpoints, client_state={"losses": losses}, keep_last=2)
    val = _validation_loss(engine, val_bytes, args.block_size)
    peaks = _per_rank(engine, float(peak_rss_bytes()))
    breakdown = engine.memory_breakdown()
    # Whole parameters on every rank (a collective at stage 3), so rank 0 can sample alone.
    with zerotrain.zero.GatheredParameters(model.parameters()):
        sample_bytes = generate(model, b"The ", 160, seed=args.seed) if rank0 else b""
    if not rank0:
        return
    sample = sample_bytes.decode("utf-8", errors="replace")

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    lines = [
        f"zerotrain demo: {params:,} parameters, ZeRO stage {args.stage}, "
        f"{engine.comm.world_size} ranks, steps {first_step + 1}-{args.steps} in "
        f"{elapsed:.0f}s ({tokens_per_step * (args.steps - first_step) / elapsed:,.0f} tokens/s)",
        f"checkpoint: {checkpoints / f'global_step{engine.global_steps}'} (resume with --resume; "
        f"zerotrain consolidate {checkpoints} model.safetensors)",
        f"training loss: {first:.3f} (first 10 steps) -> {last:.3f} (last 10 steps); "
        f"uniform guessing is {math.log(256):.3f}",
        f"validation loss: {val:.3f} ({val / math.log(2):.2f} bits/byte)",
        "peak memory per rank (RSS): "
        + ", ".join(f"rank {r} {format_bytes(m)}" for r, m in enumerate(peaks)),
        f"model states on this rank: {breakdown}",
        "",
        f"model-state bytes per rank with {engine.comm.world_size} ranks "
        "(ZeRO formulas, fp32 Adam):",
        *(
            f"  {name:<32} {format_bytes(b):>10}"
            for name, b in _zero_projection(params, engine.comm.world_size)
        ),
        _plot(losses, out / "loss_curve.png"),
        "",
        "sample (prompt 'The '):",
        "The " + sample,
    ]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

"""One rank of a benchmark run (launched by ``benchmarks/run.py`` through torchrun).

Trains the demo GPT with one system (zerotrain at a ZeRO stage, PyTorch DDP, FSDP2,
ZeroRedundancyOptimizer, or DeepSpeed) on the same data, and writes this rank's
measurements as JSON: step time, peak RSS, model-state bytes and bytes communicated per
step (the ZeRO paper's volume model, as ``zerotrain.comm.stats`` defines it).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.examples.corpus import load_corpus
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.utils.memory import current_rss_bytes, peak_rss_bytes

SIZES = {
    # ~3M parameters: per-step overhead dominates.
    "small": (GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256), 8),
    # ~25M parameters: compute dominates.
    "medium": (GPTConfig(block_size=128, n_layer=8, n_head=8, n_embd=512), 4),
}
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0


@dataclass
class Counter:
    """Bytes moved by collectives, in the paper's model (all-reduce of S counts 2S)."""

    bytes: int = 0
    calls: int = 0

    def add(self, nbytes: int, factor: int = 1) -> None:
        self.bytes += factor * nbytes
        self.calls += 1


@dataclass
class System:
    """A training system under test. ``comm_bytes`` is None where bytes are not measured."""

    step: Callable[[torch.Tensor, torch.Tensor], float]
    state_bytes: Callable[[], dict[str, int]]
    comm_bytes: Callable[[], int] | None = None


def _tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _optimizer_state(opt: torch.optim.Optimizer) -> int:
    return _tensor_bytes(v for s in opt.state.values() for v in s.values())


def _torch_adamw(params: Any) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)


def _plain_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, autocast: bool = False
) -> Callable[..., float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return float(loss.detach())

    return step


def _torch_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[], dict[str, int]]:
    def state() -> dict[str, int]:
        params = list(model.parameters())
        return {
            "params": _tensor_bytes(params),
            "grads": _tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _optimizer_state(opt),
        }

    return state


def _engine_config(stage: int, micro: int, bf16: bool = False) -> dict[str, Any]:
    """The same DeepSpeed-format config for zerotrain and DeepSpeed."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }


def _engine_step(engine: Any) -> Callable[[torch.Tensor, torch.Tensor], float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


def build_zerotrain(model: GPT, stage: int, micro: int, bf16: bool) -> System:
    import zerotrain

    config = _engine_config(stage, micro, bf16)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)

    def state() -> dict[str, int]:
        b = engine.memory_breakdown()
        return {
            "params": b.params,
            "grads": b.grads,
            "optimizer": b.optimizer_states + b.master_weights,
        }

    def comm_bytes() -> int:
        snap = engine.comm_stats()
        return snap.get(purpose="gradients").bytes + snap.get(purpose="parameters").bytes

    return System(_engine_step(engine), state, comm_bytes=comm_bytes)


def _counting_allreduce_hook(counter: Counter, allreduce_hook: Any) -> Any:
    # DDP inspects the hook's annotations and needs real classes, not the strings that
    # ``from __future__ import annotations`` would leave, so they are set explicitly.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        counter.add(bucket.buffer().numel() * bucket.buffer().element_size(), factor=2)
        return allreduce_hook(state, bucket)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


def build_ddp(model: GPT, bf16: bool = False) -> System:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    counter = Counter()

    ddp.register_comm_hook(dist.group.WORLD, _counting_allreduce_hook(counter, allreduce_hook))
    opt = _torch_adamw(ddp.parameters())
    # bf16: PyTorch's usual mixed precision, fp32 parameters with bf16 autocast compute.
    step = _plain_step(ddp, opt, autocast=bf16)
    return System(step, _torch_state(model, opt), lambda: counter.bytes)


@contextlib.contextmanager
def _count(counter: Counter, name: str, arg: int, factor: int = 1) -> Iterator[None]:
    """Count the bytes of positional argument ``arg`` of every ``dist.<name>`` call."""
    original = getattr(dist, name)
    params = list(inspect.signature(original).parameters)

    def counted(*args: Any, **kwargs: Any) -> Any:
        tensor = args[arg] if len(args) > arg else kwargs[params[arg]]
        counter.add(tensor.numel() * tensor.element_size(), factor)
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        yield
    finally:
        setattr(dist, name, original)


def build_zero_redundancy(model: GPT) -> System:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    counter = Counter()

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.register_comm_hook(dist.group.WORLD, _counting_allreduce_hook(counter, allreduce_hook))
    try:
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            fused=True,
        )
    except (RuntimeError, TypeError, ValueError):
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY
        )
    plain = _plain_step(ddp, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with _count(counter, "broadcast", 0):
            return plain(x, y)

    def state() -> dict[str, int]:
        params = list(model.parameters())
        return {
            "params": _tensor_bytes(params),
            "grads": _tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _optimizer_state(opt.optim),
        }

    return System(step, state, lambda: counter.bytes)


def build_fsdp2(model: GPT, bf16: bool) -> System:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16: FSDP2 keeps fp32 sharded parameters (its master copy), gathers them in bf16 and
    # reduces gradients in fp32, like zerotrain's defaults.
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = _torch_adamw(model.parameters())
    counter = Counter()
    plain = _plain_step(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        # The paper's volume: an all-gather moves its full output, a reduce-scatter its input.
        with _count(counter, "all_gather_single", 0), _count(counter, "reduce_scatter_single", 1):
            return plain(x, y)

    return System(step, _torch_state(model, opt), lambda: counter.bytes)


def build_deepspeed(model: GPT, stage: int, micro: int, bf16: bool) -> System:
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_engine_config(stage, micro, bf16),
    )

    def state() -> dict[str, int]:
        inner = getattr(opt, "optimizer", opt)
        params = list(model.parameters())
        grads = _tensor_bytes(p.grad for p in params if p.grad is not None)
        averaged = getattr(opt, "averaged_gradients", None) or {}
        grads += _tensor_bytes(t for ts in averaged.values() if ts for t in ts)
        # ZeRO 1-2 keep an fp32 copy of this rank's partition for the optimizer, even when
        # the model itself is fp32: counted with the optimizer states it belongs to.
        masters = list(getattr(opt, "single_partition_of_fp32_groups", None) or [])
        grads += _tensor_bytes(m.grad for m in masters if m.grad is not None)
        return {
            "params": _tensor_bytes(params),
            "grads": grads,
            "optimizer": _optimizer_state(inner) + _tensor_bytes(masters),
        }

    return System(_engine_step(engine), state)


def batches(cfg: GPTConfig, micro: int, rank: int, world: int, count: int) -> list[Any]:
    data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - cfg.block_size - 1, (micro,), generator=gen)
        window = data[starts[:, None] + torch.arange(cfg.block_size + 1)]
        out.append((window[:, :-1], window[:, 1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, micro = SIZES[args.size]
    data = batches(cfg, micro, rank, world, args.warmup + args.steps)
    baseline_rss = current_rss_bytes()
    torch.manual_seed(0)
    model = GPT(cfg)
    # "<name>[-<stage>][-bf16]": bf16 mixed precision, each system's own way (DDP: autocast).
    spec = args.system.removesuffix("-bf16")
    bf16 = spec != args.system
    name, _, stage = spec.partition("-")
    if name == "zerotrain":
        system = build_zerotrain(model, int(stage), micro, bf16)
    elif name == "deepspeed":
        system = build_deepspeed(model, int(stage), micro, bf16)
    elif name == "ddp":
        system = build_ddp(model, bf16)
    elif name == "zero1torch":
        system = build_zero_redundancy(model)
    elif name == "fsdp2":
        system = build_fsdp2(model, bf16)
    else:
        raise SystemExit(f"unknown system {args.system}")

    losses = [system.step(*data[i]) for i in range(args.warmup)]
    comm_before = system.comm_bytes() if system.comm_bytes else 0
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(system.step(*data[i]))
    dist.barrier()
    elapsed = time.perf_counter() - start
    comm_after = system.comm_bytes() if system.comm_bytes else None
    result = {
        "system": args.system,
        "size": args.size,
        "rank": rank,
        "world": world,
        "params": sum(p.numel() for p in GPT(cfg).parameters()),
        "tokens_per_step": micro * cfg.block_size * world,
        "steps": args.steps,
        "elapsed": elapsed,
        "peak_rss": peak_rss_bytes(),
        "baseline_rss": baseline_rss,
        "state": system.state_bytes(),
        "comm_per_step": None if comm_after is None else (comm_after - comm_before) / args.steps,
        "losses": losses,
    }
    with open(os.path.join(args.out, f"{args.system}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

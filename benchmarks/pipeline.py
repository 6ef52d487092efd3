"""Pipeline parallelism on one host: zerotrain's 1F1B against PyTorch's and against ZeRO DP.

Two ranks on this machine (gloo), M micro-batches per step, two models (an 8-block MLP and
the demo GPT, untied so that PyTorch's pipelining, which has no weight tying, runs the same
model), three systems on the same layers, the same data and AdamW:

- ``zt-1f1b``: ``zerotrain.initialize`` on a ``PipelineModule`` (2 stages, data parallel 1,
  ZeRO stage 1, ``grad_reduce: end_of_step``), ``engine.train_batch``;
- ``torch-1f1b``: ``torch.distributed.pipelining`` ``Schedule1F1B`` over a ``PipelineStage``
  wrapping the same ``PipelineModule`` stage (so the same layers on each stage), with
  ``torch.optim.AdamW`` (fused);
- ``zt-dp``: zerotrain ZeRO stage 1 data parallelism over the same 2 ranks, the whole model
  (the same layers in an ``nn.Sequential``) on each, M/2 micro-batches of the same size per
  rank per step (the same global batch), ``engine(x)`` / ``engine.backward`` / ``engine.step``.

Every system starts from the same weights and sees the same micro-batches, so their losses
must agree (the ``loss`` column). Time: one job (2 processes) per model and repeat holding
all the systems, which take turns step by step in a rotating order (the machine's drifting
load affects them alike); each step starts after a barrier and its time is the slower
rank's. "step ms" is the median over repeats of each job's median step; "speed vs X" is
paired: the median over every measured round of X's step time over the system's in the same
round. Memory: one more job per system, alone in its processes, with the saved-tensor
tracker and glibc mapping every allocation >= 64 KiB on its own (so frees leave the
resident set):

- ``saved-for-backward``: the peak over the measured steps of the bytes of the storages
  that autograd holds for backward (``saved_tensors_hooks``: a storage counts once from the
  first pack of any tensor on it until the last packed reference is released; parameter
  storages are not counted);
- ``saved + p2p``: the same peak with the tensors handed to point-to-point ops (zerotrain's
  ``Communicator.post_in_order``, PyTorch's ``schedules._batch_p2p``) counted as well, each storage
  from its post until the Python tensor object posted is freed (a storage counts once,
  whether saved, posted or both);
- ``RSS growth``: peak resident memory during the measured steps above the resident memory
  before them (everything the step allocates: activations, buffers, temporaries);
- ``peak RSS``: the resident high-water mark over the measured steps (includes ~240 MiB of
  torch); ``model states``: params + grads + optimizer states (``memory_breakdown()``).

The last part times same-host point-to-point transports: a ping-pong of one message between
the 2 ranks through ``Communicator.post_in_order`` (what the pipeline executor uses: the
shared-memory mailbox on one host; tagged isend/irecv over gloo TCP without shared memory,
as between hosts), ``Communicator.exchange`` (the pairwise shared-memory channel) and
``Communicator.exchange`` without shared memory (gloo plus the header check).

    OMP_NUM_THREADS=1 python benchmarks/pipeline.py [--quick] [--plot benchmarks/pipeline_p2p.png]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import shlex
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SYSTEMS = ("zt-1f1b", "torch-1f1b", "zt-dp")
MODELS = ("mlp", "gpt")
LR, WEIGHT_DECAY = 1e-3, 0.01
P2P_COLUMNS = (
    "post (shm mailbox)",
    "post (gloo TCP)",
    "exchange (shm channel)",
    "exchange (gloo + header)",
)


# -- models --------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """A residual feed-forward block: ``x + W2 gelu(W1 x)`` (4x expansion)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model: its layer list, loss and a global batch for a step."""

    name: str
    micro_batch: int
    width: int = 0  # MLP only
    blocks: int = 8
    seq: int = 128  # GPT only
    gpt_width: int = 128
    heads: int = 4

    def gpt_config(self) -> Any:
        from zerotrain.examples.gpt import GPTConfig

        return GPTConfig(
            n_layer=self.blocks,
            n_embd=self.gpt_width,
            n_head=self.heads,
            block_size=self.seq,
            tie_weights=False,  # torch.distributed.pipelining cannot tie across stages
        )

    def layers(self) -> list[Any]:
        from zerotrain.examples.gpt import gpt_pipeline_layers
        from zerotrain.pipe import LayerSpec

        if self.name == "mlp":
            return [LayerSpec(MLPBlock, self.width) for _ in range(self.blocks)]
        return gpt_pipeline_layers(self.gpt_config())

    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        from zerotrain.examples.gpt import gpt_loss_fn

        return F.mse_loss if self.name == "mlp" else gpt_loss_fn

    def batch(self, step: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``micro_batches * micro_batch`` samples."""
        g = torch.Generator().manual_seed(1000 + step)
        n = micro_batches * self.micro_batch
        if self.name == "mlp":
            return torch.randn(n, self.width, generator=g), torch.randn(n, self.width, generator=g)
        tokens = torch.randint(0, 256, (n, self.seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def describe(self) -> str:
        if self.name == "mlp":
            return (
                f"MLP: {self.blocks} residual blocks [Linear({self.width}, {4 * self.width}), "
                f"GELU, Linear({4 * self.width}, {self.width})], MSE loss, micro-batch "
                f"{self.micro_batch} rows"
            )
        return (
            f"GPT: GPTConfig(n_layer={self.blocks}, n_embd={self.gpt_width}, "
            f"n_head={self.heads}, block_size={self.seq}, tie_weights=False), micro-batch "
            f"{self.micro_batch} sequences of {self.seq} tokens"
        )


def _pipeline_module(spec: ModelSpec, stages: int, stage_id: int | None = None) -> Any:
    from zerotrain.parallel.topology import Topology
    from zerotrain.pipe import PipelineModule

    placement: dict[str, Any] = (
        {"topology": Topology.from_world(stages, pipe=stages)}
        if stage_id is None
        else {"num_stages": stages, "stage_id": stage_id}
    )
    return PipelineModule(spec.layers(), loss_fn=spec.loss_fn(), seed_layers=True, **placement)


# -- memory: what autograd saves and what point-to-point holds -----------------------------


class LiveStorages:
    """Bytes of the storages held live by registered references, and their peak.

    A storage counts once (by its data pointer) from its first reference until its last one
    is released; storages in ``exclude`` (the parameters') never count.
    """

    def __init__(self) -> None:
        self.exclude: set[int] = set()
        self.refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, references]
        self.bytes = 0
        self.peak = 0

    def acquire(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.exclude:
            return None
        entry = self.refs.get(ptr)
        if entry is None:
            self.refs[ptr] = [nbytes, 1]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1
        return ptr

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[ptr]
            self.bytes -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def hold_while_alive(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until the tensor object ``t`` is freed."""
        ptr = self.acquire(t)
        if ptr is not None:
            weakref.finalize(t, self.release, ptr)


class _Saved:
    """What the pack hook hands autograd: the tensor, released when autograd drops it."""

    __slots__ = ("held", "tensor")

    def __init__(self, tensor: torch.Tensor, trackers: tuple[LiveStorages, ...]) -> None:
        self.tensor = tensor
        self.held = [(t, t.acquire(tensor)) for t in trackers]

    def __del__(self) -> None:
        for tracker, ptr in self.held:
            if ptr is not None:
                tracker.release(ptr)


@contextlib.contextmanager
def tracking_saved(*trackers: LiveStorages) -> Iterator[None]:
    """Count what autograd saves for backward in every tracker of ``trackers``."""
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: _Saved(t, trackers), lambda s: s.tensor
    ):
        yield


def _map_every_allocation() -> None:
    """glibc: serve allocations >= 64 KiB by mmap, so freed tensors leave the resident set."""
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold, m_trim_threshold = -3, -1
    libc.mallopt(m_mmap_threshold, 65536)
    libc.mallopt(m_trim_threshold, 65536)


# -- the three systems ----------------------------------------------------------------------


@dataclass
class System:
    """One rank's side of a system: ``step(step_index)`` trains one global batch."""

    step: Callable[[int], float]
    state_bytes: Callable[[], int]
    params: list[nn.Parameter]
    track_p2p: Callable[[LiveStorages], None]


def _zt_config(micro: int, accumulation: int, pipeline: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        # The PyTorch loops check nothing: no gradient norm, no inf/NaN check, so the same
        # work (zerotrain then computes no norm and makes no cross-stage all-reduce).
        "non_finite_gradients": {"action": "ignore"},
    }
    if pipeline:
        config["pipeline"] = {"stages": 2, "schedule": "1f1b", "grad_reduce": "end_of_step"}
    return config


def _zt_state(engine: Any) -> Callable[[], int]:
    def state() -> int:
        b = engine.memory_breakdown()
        return b.params + b.grads + b.master_weights + b.optimizer_states

    return state


def build_zt_1f1b(spec: ModelSpec, micro_batches: int) -> System:
    import zerotrain

    engine, _, _, _ = zerotrain.initialize(
        model=_pipeline_module(spec, 2), config=_zt_config(spec.micro_batch, micro_batches, True)
    )

    def step(i: int) -> float:
        x, y = spec.batch(i, micro_batches)
        mb = spec.micro_batch
        pairs = [(x[m * mb : (m + 1) * mb], y[m * mb : (m + 1) * mb]) for m in range(micro_batches)]
        return float(engine.train_batch(iter(pairs)))

    def track_p2p(tracker: LiveStorages) -> None:
        comm = engine.executor.comm
        post = comm.post_in_order

        def counting_post(ops: Any) -> Any:
            for op in ops:
                tracker.hold_while_alive(op.tensor)
            return post(ops)

        comm.post_in_order = counting_post  # this process's communicator instance only

    return System(step, _zt_state(engine), list(engine.module.parameters()), track_p2p)


def _torch_adamw(params: Any) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)


def _torch_state(module: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], int]:
    def state() -> int:
        total = 0
        for p in module.parameters():
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        for s in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
        return total

    return state


def build_torch_1f1b(spec: ModelSpec, micro_batches: int) -> System:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.pipelining import schedules as torch_schedules

    rank = dist.get_rank()
    module = _pipeline_module(spec, 2, stage_id=rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=spec.loss_fn())
    opt = _torch_adamw(module.parameters())

    def step(i: int) -> float:
        x, y = spec.batch(i, micro_batches)
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as zerotrain's do
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        opt.step()
        return float(torch.stack(losses).mean()) if losses else float("nan")

    def track_p2p(tracker: LiveStorages) -> None:
        batch_p2p = torch_schedules._batch_p2p

        def counting_batch_p2p(ops: Any, desc: str | None = None) -> Any:
            for op in ops:
                tracker.hold_while_alive(op.tensor)
            return batch_p2p(ops, desc=desc)

        torch_schedules._batch_p2p = counting_batch_p2p  # this process only

    return System(step, _torch_state(module, opt), list(module.parameters()), track_p2p)


def build_zt_dp(spec: ModelSpec, micro_batches: int) -> System:
    import zerotrain

    world, rank = dist.get_world_size(), dist.get_rank()
    whole = _pipeline_module(spec, 1, stage_id=0)  # the same seeded layers, built on one rank
    model = nn.Sequential(*(whole.get_submodule(str(i)) for i in range(whole.num_layers)))
    accumulation = micro_batches // world
    engine, _, _, _ = zerotrain.initialize(
        model=model, config=_zt_config(spec.micro_batch, accumulation, False)
    )
    loss_fn = spec.loss_fn()

    def step(i: int) -> float:
        x, y = spec.batch(i, micro_batches)
        mb, total = spec.micro_batch, 0.0
        for k in range(accumulation):
            m = rank + world * k  # this rank's share of the same micro-batches
            loss = loss_fn(engine(x[m * mb : (m + 1) * mb]), y[m * mb : (m + 1) * mb])
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        mean = torch.tensor(total / accumulation)
        dist.all_reduce(mean)  # the batch's loss on every rank, as train_batch returns it
        return float(mean) / world

    return System(step, _zt_state(engine), list(engine.module.parameters()), lambda _: None)


BUILDERS = {"zt-1f1b": build_zt_1f1b, "torch-1f1b": build_torch_1f1b, "zt-dp": build_zt_dp}


# -- one job (runs on every rank) ------------------------------------------------------------


def _timing_job(
    systems: list[str], spec: ModelSpec, micro_batches: int, warmup: int, steps: int
) -> dict[str, dict[str, list[float]]]:
    """Every system of ``systems`` in this process, taking turns step by step (in an order
    that rotates every round), so that drift of the machine's speed affects them alike.
    Each step starts after a barrier. This rank's step times and losses by system."""
    built = {name: BUILDERS[name](spec, micro_batches) for name in systems}
    out: dict[str, dict[str, list[float]]] = {n: {"times": [], "losses": []} for n in systems}
    for i in range(warmup + steps):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            loss = built[name].step(i)
            seconds = time.perf_counter() - start
            out[name]["losses"].append(loss)
            if i >= warmup:
                out[name]["times"].append(seconds)
    return out


def _memory_job(
    system: str, spec: ModelSpec, micro_batches: int, warmup: int, steps: int
) -> dict[str, Any]:
    """``system`` alone in this process (its memory is its own): ``warmup`` steps, then
    ``steps`` measured ones; this rank's peaks and model-state bytes."""
    from zerotrain.utils.memory import PeakRSSMeter, peak_rss_bytes

    _map_every_allocation()
    sysm = BUILDERS[system](spec, micro_batches)
    for i in range(warmup):
        sysm.step(i)
    saved, both = LiveStorages(), LiveStorages()  # saved tensors; saved tensors + p2p
    saved.exclude = both.exclude = {p.untyped_storage().data_ptr() for p in sysm.params}
    sysm.track_p2p(both)
    with tracking_saved(saved, both), PeakRSSMeter() as meter:
        for i in range(warmup, warmup + steps):
            dist.barrier()
            sysm.step(i)
    return {
        "saved": saved.peak,
        "saved_p2p": both.peak,
        "rss_growth": meter.increase_bytes,
        "peak_rss": peak_rss_bytes(),
        "state": sysm.state_bytes(),
    }


# -- same-host point-to-point ----------------------------------------------------------------


def _ping_pong(
    issue: Callable[[list[Any]], None], x: torch.Tensor, y: torch.Tensor, rank: int, tag: int
) -> None:
    """Rank 0 sends ``x`` and receives ``y`` back; rank 1 the other way round."""
    from zerotrain.comm import P2POp

    peer = 1 - rank
    send = [P2POp.send(x, peer, purpose="bench", tag=tag)]
    recv = [P2POp.recv(y, peer, purpose="bench", tag=tag)]
    for ops in (send, recv) if rank == 0 else (recv, send):
        issue(ops)


def _p2p_job(sizes: list[int], repeats: int) -> dict[tuple[int, str], float]:
    """Median one-way time (half a ping-pong) per message size and transport, in seconds."""
    from zerotrain.comm import Communicator

    shared = Communicator()  # exchange: the pairwise shared-memory channel
    gloo = Communicator(shared_memory=False)  # exchange: gloo with the header check
    if not shared.shared_memory_peers:
        raise RuntimeError("no shared-memory channel to the peer")
    issuers: dict[str, Callable[[list[Any]], None]] = {
        P2P_COLUMNS[0]: lambda ops: [h.wait() for h in shared.post_in_order(ops)],
        P2P_COLUMNS[1]: lambda ops: [h.wait() for h in gloo.post_in_order(ops)],
        P2P_COLUMNS[2]: lambda ops: shared.exchange(ops).wait(),
        P2P_COLUMNS[3]: lambda ops: gloo.exchange(ops).wait(),
    }
    out: dict[tuple[int, str], float] = {}
    for size in sizes:
        x = torch.randn(size // 4)
        y = torch.empty_like(x)
        times: dict[str, list[float]] = {name: [] for name in issuers}
        for i in range(repeats + 1):
            for name, issue in issuers.items():  # the transports take turns
                shared.barrier()
                start = time.perf_counter()
                _ping_pong(issue, x, y, shared.rank, tag=i)
                if i:  # the first round trip warms up connections and buffers
                    times[name].append((time.perf_counter() - start) / 2)
        for name, samples in times.items():
            out[(size, name)] = statistics.median(samples)
    return out


# -- the driver -------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _size_label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def run_models(args: argparse.Namespace, specs: dict[str, ModelSpec]) -> dict[str, Any]:
    """Per model: ``repeats`` timing jobs (all systems in each), then one memory job per
    system."""
    from zerotrain.testing.dist import run_distributed

    times: dict[tuple[str, str], list[float]] = {}  # per repeat: the median step
    rounds: dict[tuple[str, str], list[float]] = {}  # every measured step, in order
    losses: dict[tuple[str, str], list[float]] = {}
    memory: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for model in args.models:
        for repeat in range(args.repeats):
            ranks = run_distributed(
                _timing_job, 2, args.systems, specs[model], args.micro_batches, args.warmup,
                args.steps, timeout=args.timeout,
            )  # fmt: skip
            for system in args.systems:
                per_step = [max(r[system]["times"][k] for r in ranks) for k in range(args.steps)]
                times.setdefault((model, system), []).append(statistics.median(per_step))
                rounds.setdefault((model, system), []).extend(per_step)
                # torch's schedule has the losses on the last stage only; the others, everywhere
                losses[(model, system)] = ranks[-1][system]["losses"]
            cells = ", ".join(f"{s} {1000 * times[(model, s)][-1]:.1f}" for s in args.systems)
            print(f"[{repeat + 1}/{args.repeats}] {model} ms/step: {cells}", flush=True)
        for system in args.systems:
            memory[(model, system)] = run_distributed(
                _memory_job, 2, system, specs[model], args.micro_batches, args.warmup,
                args.steps, timeout=args.timeout,
            )  # fmt: skip
            print(f"[memory] {model} {system}: done", flush=True)
    return {"times": times, "rounds": rounds, "losses": losses, "memory": memory}


def _speed(results: dict[str, Any], model: str, system: str, reference: str) -> str:
    """How much faster ``system`` ran than ``reference``: the median over rounds of the
    reference's step time over the system's in the same round (paired, so that the
    machine's load, which drifts between rounds, cancels)."""
    ours, theirs = results["rounds"][(model, system)], results["rounds"][(model, reference)]
    return f"{statistics.median(b / a for a, b in zip(ours, theirs, strict=True)):.3f}"


def model_tables(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    references = [s for s in ("torch-1f1b", "zt-dp") if s in args.systems]
    lines = []
    for model in args.models:
        lines += [
            f"#### {model}",
            "",
            "| system | step ms, median of repeats (range) "
            + "".join(f"| speed vs {r} " for r in references)
            + "| saved-for-backward peak MiB (stage 0 / 1) "
            "| saved + p2p peak MiB (stage 0 / 1) | RSS growth MiB (stage 0 / 1) "
            "| peak RSS MiB (stage 0 / 1) | model states MiB (rank 0 / 1) | loss first / last |",
            "|---|---|" + "---|" * len(references) + "---|---|---|---|---|---|",
        ]
        for system in args.systems:
            runs = results["times"][(model, system)]
            mem = results["memory"][(model, system)]

            def pair(key: str, mem: list[dict[str, Any]] = mem) -> str:
                return " / ".join(_mib(r[key]) for r in mem)

            loss = results["losses"][(model, system)]
            speeds = "".join(f"| {_speed(results, model, system, r)} " for r in references)
            lines.append(
                f"| {system} | {1000 * statistics.median(runs):.1f} "
                f"({1000 * min(runs):.0f}-{1000 * max(runs):.0f}) {speeds}| {pair('saved')} "
                f"| {pair('saved_p2p')} | {pair('rss_growth')} | {pair('peak_rss')} "
                f"| {pair('state')} | {loss[0]:.4f} / {loss[-1]:.4f} |"
            )
        lines.append("")
    return lines


def p2p_table(sizes: list[int], result: dict[tuple[int, str], float]) -> list[str]:
    head = " | ".join(f"{c}: µs, GB/s" for c in P2P_COLUMNS)
    lines = [
        f"| message | {head} | post: gloo TCP / mailbox |",
        "|---|" + "---|" * (len(P2P_COLUMNS) + 1),
    ]
    for size in sizes:
        cells = " | ".join(
            f"{1e6 * result[(size, c)]:.0f}, {size / result[(size, c)] / 1e9:.2f}"
            for c in P2P_COLUMNS
        )
        ratio = result[(size, P2P_COLUMNS[1])] / result[(size, P2P_COLUMNS[0])]
        lines.append(f"| {_size_label(size)} | {cells} | {ratio:.2f} |")
    return lines


def plot_p2p(path: str, sizes: list[int], result: dict[tuple[int, str], float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(10, 4))
    for column in P2P_COLUMNS:
        secs = [result[(s, column)] for s in sizes]
        ax_t.plot(sizes, [1e6 * t for t in secs], marker="o", label=column)
        ax_bw.plot(sizes, [s / t / 1e9 for s, t in zip(sizes, secs, strict=True)], marker="o")
    for ax, label in ((ax_t, "one-way time (µs)"), (ax_bw, "bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.legend(fontsize=8)
    fig.suptitle("Same-host point-to-point between 2 ranks (half a ping-pong, median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 warm-up, 2 steps")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--micro-batches", type=int, default=8, help="M, per step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per job")
    parser.add_argument("--mlp-width", type=int, default=512)
    parser.add_argument("--mlp-micro-batch", type=int, default=32)
    parser.add_argument("--gpt-micro-batch", type=int, default=4)
    parser.add_argument("--p2p-sizes", default="64K,256K,1M,4M,16M")
    parser.add_argument("--p2p-repeats", type=int, default=20)
    parser.add_argument("--plot", help="write the p2p figure to this PNG")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.steps, args.p2p_repeats = 1, 1, 2, 3
    args.models = [m for m in args.models.split(",") if m]
    args.systems = [s for s in args.systems.split(",") if s]  # none: only the p2p table
    if args.micro_batches % 2:
        parser.error("--micro-batches must be even (data parallelism splits it over 2 ranks)")
    specs = {
        "mlp": ModelSpec("mlp", args.mlp_micro_batch, width=args.mlp_width),
        "gpt": ModelSpec("gpt", args.gpt_micro_batch),
    }
    from zerotrain.testing.dist import run_distributed

    command = "OMP_NUM_THREADS=1 python benchmarks/pipeline.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:]
    )
    report = [f"`{command}`", ""]
    report += [f"- {specs[m].describe()}" for m in args.models] + [""]
    if args.systems:
        report += model_tables(args, run_models(args, specs))
    sizes = [_size(s) for s in args.p2p_sizes.split(",") if s]
    if sizes:
        p2p = run_distributed(_p2p_job, 2, sizes, args.p2p_repeats, timeout=args.timeout)[0]
        report += ["#### same-host point-to-point, 2 ranks", "", *p2p_table(sizes, p2p)]
        if args.plot:
            plot_p2p(args.plot, sizes, p2p)
    print("\n".join(report))


if __name__ == "__main__":
    main()

r"""``zerotrain estimate``: per-rank memory of a ZeRO configuration, and the largest model
that fits a memory budget, without running anything.

    zerotrain estimate --params 7B --world-size 8 --stage 3 --dtype bf16 --memory 80GiB
    zerotrain estimate --model mypkg.models:build --world-size 2 --stage 2 \
        --micro-batch 8 --seq-len 1024
    zerotrain estimate --model mypkg.models:layers --world-size 16 --pp 2 --tp 2 --sp 2 \
        --tp-preset llama --stage 1 --rank 5

With ``--tp/--pp/--sp`` the world size is the whole job and data parallelism takes the
rest; ``--rank`` is a rank of the job. With ``--model`` the rank's own piece is built on
the meta device (its pipeline stage, its tensor slices) and estimated exactly; with
``--params`` the count is divided by ``tp x pp`` (approximate).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

import torch
from torch import nn

from zerotrain.estimate import (
    TransformerShape,
    estimate_memory,
    largest_model_that_fits,
    parse_bytes,
    parse_count,
)
from zerotrain.estimate.core import DTYPE_BYTES, OFFLOAD_TARGETS
from zerotrain.estimate.layout import rank_piece
from zerotrain.estimate.model_states import OPTIMIZER_STATES
from zerotrain.estimate.shapes import transformer_shape_of
from zerotrain.parallel.pipeline.specs import LayerSpec
from zerotrain.parallel.topology import ZERO_AXES, Topology
from zerotrain.utils.memory import format_bytes


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``zerotrain estimate``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count: 7e9, 1.3B, 350M")
    what.add_argument(
        "--model",
        help="module:factory, a callable returning the nn.Module (built on the meta device, "
        "so its exact shapes cost no memory)",
    )
    parser.add_argument(
        "--world-size", type=int, required=True, help="ranks of the job (all axes together)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (--model must return the layer list)"
    )
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree")
    parser.add_argument(
        "--tp-preset",
        default=None,
        help="AutoTP preset_model for the tensor split (default: the model's _tp_plan)",
    )
    parser.add_argument("--stage", type=int, required=True, help="ZeRO stage 0-3")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    parser.add_argument("--grad-accum-dtype", default=None, help="fp32 or the compute dtype")
    parser.add_argument("--communication-dtype", default=None, help="fp32 or the compute dtype")
    parser.add_argument("--offload-optimizer", default="none", help="none, cpu or nvme")
    parser.add_argument("--offload-param", default="none", help="none, cpu or nvme (stage 3)")
    parser.add_argument("--optimizer", default="adam", help=", ".join(OPTIMIZER_STATES))
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=None, help="transformer hidden width")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 1)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50257)")
    parser.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="what each rank trains on"
    )
    parser.add_argument("--rank", type=int, default=0, help="which rank to report (default 0)")
    parser.add_argument(
        "--memory",
        default=None,
        help="memory per rank for the largest-model search: 24GiB, 80GB (default: this "
        "machine's GPU memory, or its RAM divided by the world size for --device cpu)",
    )


def load_factory_model(spec: str) -> nn.Module | list[LayerSpec]:
    """Import ``module:factory`` and build its model (or pipeline layer list) on the meta
    device.

    Raises:
        ValueError: ``spec`` is not ``module:factory``, or the module or callable is missing.
        TypeError: the factory is not callable or returns something other than an nn.Module.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected module:factory, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a model file next to where the command runs
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"--model {spec!r}: {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"--model {spec!r}: {attr!r} is not callable")
    with torch.device("meta"):
        built = factory()
    if isinstance(built, list) and built and all(isinstance(x, LayerSpec) for x in built):
        return built
    if not isinstance(built, nn.Module):
        raise TypeError(
            f"--model {spec!r}: {attr}() returned {type(built).__name__}, not an nn.Module "
            "or a list of pipeline LayerSpecs"
        )
    return built


def _transformer(args: argparse.Namespace) -> TransformerShape | None:
    if args.hidden is None or args.layers is None:
        if args.hidden is not None:
            raise ValueError("--hidden needs --layers too (activations are per layer)")
        return None
    return TransformerShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads or 1,
        vocab=args.vocab or 50257,
        ffn=args.ffn,
    )


def machine_memory(device: str, world_size: int) -> tuple[int, str] | None:
    """Memory per rank on this machine: one GPU's, or RAM shared by ``world_size`` ranks;
    None when a GPU is asked for and there is none."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(0).total_memory, "this machine's GPU 0"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // world_size, f"this machine's RAM / {world_size} ranks"


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "world_size": args.world_size,
        "stage": args.stage,
        "dtype": args.dtype,
        "grad_accum_dtype": args.grad_accum_dtype,
        "communication_dtype": args.communication_dtype,
        "offload_optimizer": args.offload_optimizer,
        "offload_param": args.offload_param,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "optimizer": args.optimizer,
        "device": args.device,
    }


def run_estimate(args: argparse.Namespace) -> int:
    """Print the estimate table and the largest model that fits; returns the exit status
    (2 with a message for invalid input)."""
    try:
        options = _options(args)
        transformer = _transformer(args)
        if args.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {args.dtype!r}")
        for flag in ("offload_optimizer", "offload_param"):
            if getattr(args, flag) not in OFFLOAD_TARGETS:
                raise ValueError(
                    f"--{flag.replace('_', '-')} must be one of {', '.join(OFFLOAD_TARGETS)}, "
                    f"got {getattr(args, flag)!r}"
                )
        topology = Topology.from_world(
            args.world_size, pipe=args.pp, tensor=args.tp, sequence=args.sp
        )
        built = load_factory_model(args.model) if args.model else parse_count(args.params)
        model: nn.Module | int
        isolate: tuple[str, ...] = ()
        if isinstance(built, int):
            model = built // (args.tp * args.pp)
            zero_rank = topology.group_ranks(ZERO_AXES, args.rank).index(args.rank)
            if model != built:
                print(f"parameters per rank taken as {built:,} / (tp x pp) = {model:,}")
        else:
            piece = rank_piece(built, topology, args.rank, args.tp_preset)
            model, zero_rank, isolate = piece.model, piece.zero_rank, piece.isolate
        options["world_size"] = topology.size(ZERO_AXES)  # ZeRO shards over data x sequence
        estimate = estimate_memory(
            model,
            transformer=transformer,
            layers=args.layers,
            rank=zero_rank,
            tensor_parallel=args.tp,
            sequence_parallel=args.sp,
            isolate=isolate,
            **options,
        )
        budget = (parse_bytes(args.memory), "--memory") if args.memory else None
        budget = budget or machine_memory(args.device, args.world_size)
        print(estimate.table())
        if budget is None:
            print("largest model: no GPU here to measure; pass --memory 80GiB")
            return 0
        memory, source = budget
        fit_options = {**options, "transformer": transformer or _fit_shape(model)}
        # Each rank holds about 1 / (tp x pp) of the model.
        fits = (
            largest_model_that_fits(memory, layers=args.layers, **fit_options) * args.tp * args.pp
        )
        verdict = "fits" if estimate.total <= memory else "does NOT fit"
        print(
            f"this configuration {verdict} in {format_bytes(memory)} per rank ({source}); "
            f"largest model that fits: {fits:,} parameters ({fits / 1e9:.2f}B)"
        )
    except (ValueError, TypeError) as exc:
        print(f"zerotrain estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _fit_shape(model: nn.Module | int) -> TransformerShape | None:
    """The activation shape the search keeps fixed (read from a module's config)."""
    if isinstance(model, nn.Module):
        return transformer_shape_of(model)
    return None

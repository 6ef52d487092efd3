"""Shared pieces of the tensor-parallel tests: the demo GPT split by its own plan, trained
through the engine on a (pipe x data x tensor) grid, and the single-process reference on
the same global batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.pipeline import MICRO_BATCHES, PIPE_GPT, PipeRun, micro_batches
from tests.helpers.training import PARITY_ADAM, RunSpec, global_batches, micro_batch
from zerotrain.examples.gpt import GPT, GPTConfig, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.parallel.tensor import tensor_splits
from zerotrain.parallel.tensor.splits import even_split
from zerotrain.parallel.topology import Topology
from zerotrain.pipe import PipelineModule

# Heads, embedding width and vocabulary divisible by 4; no biases (see training.py's TINY).
TP_GPT = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, bias=False)
TP_SPEC = RunSpec(
    optimizer="AdamW",
    opt_params=dict(PARITY_ADAM),
    steps=20,
    micro_batch=2,
    grad_accum=2,
    clip=0.5,  # active: the gradient norm of this model starts near 2
    model=TP_GPT,
)
SPIKE_STEP = 10  # its targets are random tokens: a loss spike, with clipping hard at work
GLOBAL_BATCH = 8  # samples per step, whatever the layout


@dataclasses.dataclass(frozen=True)
class TensorRun:
    """One tensor-parallel configuration."""

    tensor: int
    data: int = 1
    sequence: int = 1  # Ulysses degree
    zero_stage: int = 1
    sequence_parallel: bool = False
    dropout: float = 0.0
    steps: int = TP_SPEC.steps
    plan_from: str = "model"  # "model": GPT._tp_plan; "preset": tensor_parallel.preset_model
    # activation_checkpointing of every Block; its inputs split over the tensor group
    partition_activations: bool = False

    @property
    def world(self) -> int:
        return self.data * self.sequence * self.tensor

    @property
    def grad_accum(self) -> int:
        """Micro-steps per step: the global batch stays GLOBAL_BATCH for any data degree."""
        return GLOBAL_BATCH // (TP_SPEC.micro_batch * self.data)

    @property
    def spec(self) -> RunSpec:
        return dataclasses.replace(TP_SPEC, steps=self.steps, grad_accum=self.grad_accum)

    def model_config(self) -> GPTConfig:
        return dataclasses.replace(TP_GPT, dropout=self.dropout, attn_dropout=0.0)

    def config(self) -> dict[str, Any]:
        tensor_parallel: dict[str, Any] = {"autotp_size": self.tensor}
        if self.sequence_parallel:
            tensor_parallel["sequence_parallel"] = True
        if self.plan_from == "preset":
            tensor_parallel["preset_model"] = "gpt"
        return {
            "train_micro_batch_size_per_gpu": TP_SPEC.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": TP_SPEC.clip,
            "optimizer": {"type": TP_SPEC.optimizer, "params": dict(TP_SPEC.opt_params)},
            "zero_optimization": {
                "stage": self.zero_stage,
                "reduce_bucket_size": 4000,
                "stage3_param_persistence_threshold": 0,
            },
            **({"tensor_parallel": tensor_parallel} if self.tensor > 1 else {}),
            "sequence_parallel_size": self.sequence,
            "steps_per_print": 1000,
            **(
                {
                    "activation_checkpointing": {
                        "partition_activations": True,
                        "block_types": ["Block"],
                    }
                }
                if self.partition_activations
                else {}
            ),
        }


def tp_batches(steps: int = TP_SPEC.steps) -> torch.Tensor:
    """Every step's global batch (``GLOBAL_BATCH`` samples), with a loss spike at
    ``SPIKE_STEP``."""
    spec = dataclasses.replace(
        TP_SPEC, steps=max(steps, SPIKE_STEP + 1), grad_accum=GLOBAL_BATCH // TP_SPEC.micro_batch
    )
    batches = global_batches(spec, 1).clone()
    noise = torch.Generator().manual_seed(7)
    spiked = batches[SPIKE_STEP, :, 1:]
    spiked.copy_(torch.randint(0, TP_GPT.vocab_size, spiked.shape, generator=noise))
    return batches


def tiny_llama(kv_heads: int) -> torch.nn.Module:
    """A tiny ``transformers`` Llama (4 heads, ``kv_heads`` key/value heads), seeded."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def tiny_mistral(sliding_window: int) -> torch.nn.Module:
    """A tiny ``transformers`` Mistral (4 heads, 2 key/value heads) attending to the last
    ``sliding_window`` positions only, seeded."""
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        sliding_window=sliding_window,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).float()


def build_gpt(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def whole_params(engine: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the dense model's shape: this rank's slices all-gathered over
    the tensor group (in the order each split lays them out)."""
    splits = tensor_splits(model)
    tensor = engine.groups.tensor
    found = {}
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        for name, param in model.named_parameters():
            value = param.detach().clone()
            split = splits.get(name)
            if split is None:
                found[name] = value
                continue
            pieces = torch.empty((tensor.world_size, *value.shape), dtype=value.dtype)
            tensor.all_gather_into(pieces, value.contiguous(), purpose="test")
            whole = torch.empty(split.full_shape, dtype=value.dtype)
            for rank in range(tensor.world_size):
                theirs = dataclasses.replace(
                    split,
                    blocks=even_split(
                        split.full_shape,
                        split.dim,
                        rank,
                        tensor.world_size,
                        _parts(split, tensor.world_size),
                    ).blocks,
                )
                start = 0
                for offset, length in theirs.blocks:
                    whole.narrow(split.dim, offset, length).copy_(
                        pieces[rank].narrow(split.dim, start, length)
                    )
                    start += length
            found[name] = whole
    return found


def _parts(split: Any, ranks: int) -> tuple[int, ...]:
    if len(split.blocks) == 1:
        return ()
    return tuple(length * ranks for _, length in split.blocks)


def make_engine(run: TensorRun) -> tuple[Any, GPT]:
    """Runs on every rank: the GPT split over ``run``'s data x tensor grid."""
    model = build_gpt(run.model_config())
    engine, _, _, _ = zerotrain.initialize(
        model=model,
        config=run.config(),
        topology=Topology(data=run.data, sequence=run.sequence, tensor=run.tensor),
    )
    assert dist.get_world_size() == run.world
    return engine, model


def train_steps(engine: Any, run: TensorRun, first: int, last: int) -> list[float]:
    """Runs on every rank: steps ``first..last-1``; each step's global mean loss. Under
    Ulysses each rank of a sequence group feeds its slice of the same samples."""
    data, replicas = engine.groups.data, engine.groups.zero
    batches = tp_batches(max(run.steps, last))
    spec = dataclasses.replace(run.spec, steps=max(run.steps, last))
    losses = []
    for step in range(first, last):
        total = 0.0
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, data.rank, data.world_size)
            batch = engine.shard_sequence({"idx": x, "targets": y})
            total += engine.backward(engine(**batch)).item()
            engine.step()
        # Each rank's loss is its slice's sum over the sequence's targets / P: their mean
        # over data x sequence is the global mean.
        losses.append(
            replicas.all_reduce_floats([total])[0] / (replicas.world_size * spec.grad_accum)
        )
    return losses


def train_tensor_parallel(run: TensorRun) -> dict[str, Any]:
    """Runs on every rank: ``run.steps`` steps on a data x tensor grid; the global losses
    and the whole parameters."""
    engine, model = make_engine(run)
    losses = train_steps(engine, run, 0, run.steps)
    return {"losses": losses, "params": whole_params(engine, model)}


def train_reference(run: TensorRun) -> dict[str, Any]:
    """One process, plain PyTorch: the same global batch in the same micro-batches (so that
    dropout draws the same masks in the same order: data parallelism 1 only)."""
    model = build_gpt(run.model_config())
    params = [p for p in model.parameters() if p.requires_grad]
    p = TP_SPEC.opt_params
    opt = torch.optim.AdamW(params, lr=p["lr"], weight_decay=p["weight_decay"], eps=p["eps"])
    batches = tp_batches(run.steps)
    spec = run.spec
    accum = spec.grad_accum
    losses = []
    for step in range(run.steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(accum):
            if run.data == 1:
                x, y = micro_batch(batches, spec, step, micro, 0, 1)
            else:  # the micro-step's samples of every data-parallel rank at once
                rows = [
                    micro_batch(batches, spec, step, micro, r, run.data) for r in range(run.data)
                ]
                x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
            loss = model(x, y)
            (loss / accum).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, TP_SPEC.clip)
        opt.step()
        losses.append(total / accum)
    params_now = {n: q.detach().clone() for n, q in model.named_parameters()}
    return {"losses": losses, "params": params_now}


def pipeline_tensor_engine(
    stages: int, tensor: int, zero_stage: int = 1, heads: int = 2
) -> tuple[Any, Any]:
    """Runs on every rank: the pipeline GPT over a (pipe x data x tensor) grid, its blocks
    split by DeepSpeed AutoTP's layout for it (``preset_model: "gpt"``)."""

    data = dist.get_world_size() // (stages * tensor)
    topology = Topology(pipe=stages, data=data, tensor=tensor)
    cfg = dataclasses.replace(PIPE_GPT, n_head=heads)
    module = PipelineModule(
        gpt_pipeline_layers(cfg), topology=topology, loss_fn=gpt_loss_fn, seed_layers=True
    )
    config = PipeRun(stages=stages, zero_stage=zero_stage).config(data)
    config["tensor_parallel"] = {"autotp_size": tensor, "preset_model": "gpt"}
    engine, _, _, _ = zerotrain.initialize(model=module, config=config, topology=topology)
    return engine, module


def train_pipeline_tensor(engine: Any, first: int, last: int) -> list[float]:
    """Runs on every rank: ``train_batch`` steps ``first..last-1``; their losses."""
    return [
        float(engine.train_batch(iter(micro_batches(engine, step, MICRO_BATCHES))))
        for step in range(first, last)
    ]

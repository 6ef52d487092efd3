"""The checkpoint-format-1 fixture under ``tests/data/checkpoint-v1/``: how it was made, and
the run that resumes it.

The fixture was written by zerotrain at commit d53a3e4 (the last release writing format 1)
with ``python -m tests.helpers.v1_fixture tests/data/checkpoint-v1``: a one-layer GPT with
dropout, 2 ranks, ZeRO stage 2, Adam with a WarmupDecayLR schedule, the data loader
``initialize`` builds from ``training_data``, 3 steps, then ``save_checkpoint`` with a client
state. The same run then trained 3 more steps; their losses and the final parameters are
stored beside the checkpoint (``expected.json``, ``expected_params.safetensors``), so a later
zerotrain must resume it to exactly the same place. Running the module again with a later
zerotrain writes that zerotrain's format, not format 1: the fixture is not to be regenerated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerotrain
from zerotrain.examples.corpus import load_corpus
from zerotrain.examples.gpt import GPT, GPTConfig

MODEL = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1, bias=False)
TAG = "global_step3"
CLIENT_STATE = {"note": "format-1 fixture", "step": 3, "weights": [0.5, 0.25]}


def config(world: int) -> dict[str, Any]:
    """The fixture run's config (2 ranks when it was saved)."""
    return {
        "train_batch_size": 2 * world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 20},
        },
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000},
        "steps_per_print": 1000,
    }


def dataset() -> TensorDataset:
    """64 token windows from the demo corpus."""
    data = torch.frombuffer(bytearray(load_corpus()[:20_000]), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(7)
    starts = torch.randint(0, len(data) - MODEL.block_size - 1, (64,), generator=gen)
    windows = data[starts[:, None] + torch.arange(MODEL.block_size + 1)]
    return TensorDataset(windows[:, :-1], windows[:, 1:])


def build(seed: int = 1234) -> tuple[zerotrain.Engine, Any]:
    """Runs on every rank: the fixture's model and engine, and the loader initialize built."""
    torch.manual_seed(seed)
    model = GPT(MODEL)
    engine, _, loader, _ = zerotrain.initialize(
        model=model, config=config(dist.get_world_size()), training_data=dataset()
    )
    return engine, loader


def train(engine: zerotrain.Engine, batches: Any, steps: int) -> list[float]:
    """Runs on every rank: ``steps`` optimizer steps; each step's global summed loss."""
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = engine.backward(engine(x, y)).item()
        engine.step()
        losses.append(engine.comm.all_reduce_floats([loss])[0])
    return losses


def full_params(engine: zerotrain.Engine) -> dict[str, torch.Tensor]:
    """Runs on every rank: the model's parameters, whole."""
    with zerotrain.zero.GatheredParameters(engine.module.parameters()):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _make(out: str) -> dict[str, Any]:
    engine, loader = build()
    batches = iter(loader)
    train(engine, batches, 3)
    engine.save_checkpoint(out, client_state=CLIENT_STATE)
    return {"losses": train(engine, batches, 3), "params": full_params(engine)}


def resume(path: str) -> dict[str, Any]:
    """Runs on every rank: load the fixture into a differently seeded engine and train the
    3 steps that followed the save."""
    engine, loader = build(seed=99)
    torch.manual_seed(5)
    loaded, client = engine.load_checkpoint(path)
    restored = full_params(engine)
    losses = train(engine, iter(loader), 3)
    return {
        "path": loaded,
        "client": client,
        "restored": restored,
        "losses": losses,
        "params": full_params(engine),
    }


def main(out: str) -> None:
    """Write the fixture into ``out`` (run once, at the commit named above)."""
    from zerotrain.testing.dist import run_distributed

    result = run_distributed(_make, 2, out)[0]
    root = Path(out)
    (root / "expected.json").write_text(
        json.dumps({"losses": result["losses"], "client_state": CLIENT_STATE}, indent=1) + "\n"
    )
    safetensors.torch.save_file(result["params"], str(root / "expected_params.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])

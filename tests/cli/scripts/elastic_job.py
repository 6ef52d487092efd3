"""An elastic training job for the host-loss test: resumes from the latest checkpoint in
OUT/ckpt if there is one, trains to STEPS global steps with the ``elasticity`` plan's batch
split for whatever world size it got, checkpoints every EVERY steps, and rank 0 appends one
JSON line per event to OUT/events.jsonl.

    python elastic_job.py OUT STEPS EVERY STAGE
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import zerotrain
from zerotrain.examples.gpt import GPT, GPTConfig

out, steps, every, stage = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config = {
    "elasticity": {
        "enabled": True,
        "max_train_batch_size": 16,
        "micro_batch_sizes": [2, 4],
        "min_gpus": 1,
        "max_gpus": 4,
        "version": 0.1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "gradient_clipping": 0.05,
    "zero_optimization": {"stage": stage},
    "steps_per_print": 1000,
}
gen = torch.Generator().manual_seed(7)
tokens = torch.randint(0, 64, (400, 17), generator=gen)
data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
engine, _, loader, _ = zerotrain.initialize(model=model, config=config, training_data=data)
rank, world = engine.comm.rank, engine.comm.world_size
ckpt = out / "ckpt"


def event(**fields):
    if rank == 0:
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps({**fields, "t": time.time(), "world": world}) + "\n")


if (ckpt / "latest").exists():
    engine.load_checkpoint(ckpt)
event(event="start", step=engine.global_steps)
print(f"rank {rank}: started at step {engine.global_steps} with {world} ranks", flush=True)
batches = iter(loader)
while engine.global_steps < steps:
    total, gas = 0.0, engine.gradient_accumulation_steps()
    for _ in range(gas):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        total += engine.backward(engine(x, y)).item()
        engine.step()
    loss = engine.comm.all_reduce_floats([total])[0] / (gas * world)
    event(event="step", step=engine.global_steps, loss=loss)
    if engine.global_steps % every == 0:
        engine.save_checkpoint(ckpt)
    time.sleep(0.5)  # long enough a run to lose a host in the middle of it
event(event="done", step=engine.global_steps)

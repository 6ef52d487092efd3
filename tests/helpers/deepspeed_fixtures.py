"""The DeepSpeed checkpoints under tests/data/deepspeed/: the model, data and configs that
wrote them (the tests train the same in zerotrain), and the script that writes them.

Run with DeepSpeed beside torch (not a zerotrain dependency), from the repository root:

    python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python -m tests.helpers.deepspeed_fixtures

Each case trains the tiny model below with DeepSpeed on 2 ranks over gloo for ``SAVED``
steps, saves a checkpoint (with a client state), trains ``AFTER`` more steps and records the
global-batch losses of those steps in ``expected.json``, with DeepSpeed's own fp32 view of
the saved weights (``zero_to_fp32``) beside them for the loader's exact comparison; two of
the checkpoints also in their universal form (DeepSpeed's ``ds_to_universal``).

``python -m tests.helpers.deepspeed_fixtures continue PATH STAGE PRECISION OUT.json`` has
DeepSpeed load universal checkpoint ``PATH`` (as ``zerotrain convert --to deepspeed``
writes them) and train the steps after it, for tests/dist/test_deepspeed_export.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

DATA = Path(__file__).resolve().parent.parent / "data" / "deepspeed"
# ds_to_universal's output for two of the cases, with the same expectations.
UNIVERSALS = {"universal_stage2_bf16": "stage2_bf16", "universal_stage3_fp32": "stage3_fp32"}
UNIVERSAL = "universal_stage2_bf16"
WORLD = 2
SAVED = 3
AFTER = 5
GLOBAL_BATCH = 8  # 4 per rank
CASES = {
    # name: (zero stage, precision)
    "stage0_fp32": (0, "fp32"),
    "stage1_bf16": (1, "bf16"),
    "stage2_fp32": (2, "fp32"),
    "stage2_bf16": (2, "bf16"),
    "stage3_fp32": (3, "fp32"),
    "stage3_bf16": (3, "bf16"),
    "stage1_fp16": (1, "fp16"),
    "stage3_fp16": (3, "fp16"),
}


class TinyNet(nn.Module):
    """291 parameters (an odd count, so DeepSpeed pads its partitions), a buffer, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.norm = nn.LayerNorm(12)
        self.hidden = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = torch.relu(self.hidden(self.norm(h)))
        out = self.head(h) * self.scale.to(h.dtype)
        return nn.functional.mse_loss(out.float(), y)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``; at step 4 the inputs are scaled by 30 (large gradients,
    which the clipping bounds)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    return (x * 30 if step == 4 else x), y


def config(stage: int, precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.02,
                "betas": [0.9, 0.99],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 0.02,
                "warmup_num_steps": 4,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # a window of 2 moves the dynamic scale while the test runs
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on a CPU without native fp16 support (this machine: AVX2 only);
    torch computes it anyway, slowly, which is all these tiny runs need. Only DeepSpeed's
    capability check is bypassed: the checkpoint format is its own."""
    from deepspeed.accelerator import get_accelerator  # type: ignore[import-not-found]

    get_accelerator().is_fp16_supported = lambda: True


def groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def train_steps(engine: Any, steps: Iterable[int], precision: str) -> list[float]:
    """Train ``engine`` (DeepSpeed's or zerotrain's) on the global batches of ``steps``, each
    rank on its slice; returns each step's loss over the global batch."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    per = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        x, y = batch(step)
        part = slice(rank * per, (rank + 1) * per)
        loss = engine(x[part].to(DTYPES[precision]), y[part])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _deepspeed_rank(rank: int, port: int) -> Any:
    """Become rank ``rank`` of a DeepSpeed job of ``WORLD`` ranks; returns ``deepspeed``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    import deepspeed  # type: ignore[import-not-found]

    deepspeed.init_distributed(dist_backend="gloo")
    allow_fp16_on_cpu()
    return deepspeed


def worker(rank: int, name: str, stage: int, precision: str, out: str) -> None:
    deepspeed = _deepspeed_rank(rank, 29517)
    from deepspeed.utils.zero_to_fp32 import (  # type: ignore[import-not-found]
        get_fp32_state_dict_from_zero_checkpoint,
    )

    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups(model), config=config(stage, precision)
    )
    before = train_steps(engine, range(SAVED), precision)
    engine.save_checkpoint(out, client_state={"epoch": 2, "note": "from DeepSpeed"})
    after = train_steps(engine, range(SAVED, SAVED + AFTER), precision)
    torch.distributed.barrier()
    if rank == 0:
        if stage == 0:  # no ZeRO partitions: the module's own states are the fp32 weights
            tag = (Path(out) / "latest").read_text().strip()
            saved = torch.load(Path(out) / tag / "mp_rank_00_model_states.pt", weights_only=False)
            fp32 = saved["module"]
        else:
            fp32 = get_fp32_state_dict_from_zero_checkpoint(out)
        torch.save({k: v.clone() for k, v in fp32.items()}, Path(out) / "fp32_reference.pt")
        (Path(out) / "expected.json").write_text(
            json.dumps(
                {
                    "stage": stage,
                    "precision": precision,
                    "world_size": WORLD,
                    "saved_after_steps": SAVED,
                    "losses_before": before,
                    "losses_after": after,
                    "lr_after": engine.get_lr(),
                    "loss_scale_after": (
                        engine.optimizer.loss_scaler.cur_scale if precision == "fp16" else None
                    ),
                },
                indent=1,
            )
            + "\n"
        )


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        stage, precision = CASES[name]
        out = DATA / name
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(worker, args=(name, stage, precision, str(out)), nprocs=WORLD)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its converter
            (out / script).unlink(missing_ok=True)
        print(name, "written")
    for universal_name, source in UNIVERSALS.items():
        if source not in names:
            continue
        universal = DATA / universal_name
        shutil.rmtree(universal, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(DATA / source / "global_step3"),
                "--output_folder",
                str(universal / "global_step3_universal"),
                "--inject_missing_state",
            ],
            check=True,
        )
        for file in ("expected.json", "fp32_reference.pt"):
            shutil.copy(DATA / source / file, universal / file)
        print(universal_name, "written")


def continue_worker(rank: int, path: str, stage: int, precision: str, out: str) -> None:
    """DeepSpeed loads universal checkpoint ``path`` and trains the steps after it."""
    deepspeed = _deepspeed_rank(rank, 29518)
    torch.manual_seed(99)  # other weights: the load must replace them
    model = TinyNet()
    cfg = config(stage, precision) | {"checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)
    _, client = engine.load_checkpoint(path)
    steps = engine.global_steps
    losses = train_steps(engine, range(steps, steps + AFTER), precision)
    if rank == 0:
        result = {
            "loaded_steps": steps,
            "losses": losses,
            "lr": engine.get_lr(),
            "client": {k: client.get(k) for k in ("epoch", "note")},
        }
        Path(out).write_text(json.dumps(result) + "\n")


def continue_from(path: str, stage: int, precision: str, out: str) -> None:
    """``continue PATH STAGE PRECISION OUT.json``: what DeepSpeed trains from ``PATH``."""
    mp.spawn(continue_worker, args=(path, stage, precision, out), nprocs=WORLD)


if __name__ == "__main__":
    if sys.argv[1:2] == ["continue"]:
        continue_from(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()

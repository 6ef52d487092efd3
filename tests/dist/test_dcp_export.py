"""``zerotrain convert --to dcp``: a zerotrain checkpoint as PyTorch distributed checkpoint
(DCP) files that plain PyTorch continues from.

zerotrain trains the fixture model on 2 ranks at stage 2 (two param groups, AdamW,
clipping), saves, and trains on: its continuation is the reference. The checkpoint is
converted to DCP; one plain-PyTorch process (torch's AdamW, ``clip_grad_norm_``, the same
global batches) loads the model with ``dcp.load`` and the optimizer with torch's
``set_optimizer_state_dict`` from the flattened state dict, and trains the same steps: its
losses equal zerotrain's within 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import zerotrain
from tests.helpers.deepspeed_fixtures import (
    AFTER,
    GLOBAL_BATCH,
    SAVED,
    TinyNet,
    batch,
    groups,
    train_steps,
)
from zerotrain.cli.main import main as zerotrain_cli
from zerotrain.testing.dist import run_distributed

LR, CLIP = 0.02, 0.5
CONFIG = {
    "train_batch_size": GLOBAL_BATCH,
    "gradient_clipping": CLIP,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2},
}


def _zerotrain(save_dir: str) -> list[float]:
    torch.manual_seed(0)
    model = TinyNet()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=groups(model), config=CONFIG)
    train_steps(engine, range(SAVED), "fp32")
    engine.save_checkpoint(save_dir)
    losses = train_steps(engine, range(SAVED, SAVED + AFTER), "fp32")
    engine.destroy()
    return losses


def _plain_torch(path: Path) -> list[float]:
    torch.manual_seed(1)  # other weights: the load replaces them
    model = TinyNet()
    optimizer = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        **model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict({k: v for k, v in state.items() if k != "optimizer"})
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    losses = []
    for step in range(SAVED, SAVED + AFTER):
        x, y = batch(step)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_plain_pytorch_continues_from_the_dcp_export(tmp_path: Path) -> None:
    reference = run_distributed(_zerotrain, 2, str(tmp_path / "zt"))[0]
    assert (
        zerotrain_cli(["convert", str(tmp_path / "zt"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    )
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    assert "hidden.weight" in meta  # the model at the top level, as torchtitan keeps it
    assert "optimizer.state.hidden.weight.exp_avg" in meta
    assert "zerotrain.global_steps" in meta
    ours = _plain_torch(tmp_path / "dcp")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=1e-6, atol=0)

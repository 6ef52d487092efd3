"""DeepSpeed's ``ds_*`` attributes on stage-3 parameters, read the way DeepSpeed-Chat's
export code reads them: find the released ones by ``ds_status``, gather them, copy them out."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

import zerotrain
from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus
from zerotrain.testing.dist import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _to_fetch(params: list[nn.Parameter]) -> list[nn.Parameter]:
    # DeepSpeed-Chat's _z3_params_to_fetch, verbatim in spirit.
    return [
        p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def _ds_attributes() -> None:
    reference = {n: p.detach().clone() for n, p in _model().named_parameters()}
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(3))
    named = list(engine.module.named_parameters())
    params = [p for _, p in named]
    assert len({p.ds_id for p in params}) == len(params), "ds_id must be unique"
    for name, p in named:
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert p.numel() == 0  # released: only this rank's shard exists
        assert p.ds_shape == reference[name].shape
        assert p.ds_numel == reference[name].numel()
    # Pickling a released parameter keeps what it holds: an empty tensor and its ds_* values.
    back = pickle.loads(pickle.dumps(params[0]))
    assert back.numel() == 0
    assert back.ds_shape == params[0].ds_shape
    assert back.ds_status is ZeroParamStatus.NOT_AVAILABLE
    copied = copy.deepcopy(params[0])
    assert copied.numel() == 0
    assert not hasattr(copied, "ds_id")
    fetch = _to_fetch(params)
    assert fetch == params
    exported = {}
    with zerotrain.zero.GatheredParameters(fetch):
        for name, p in named:
            assert p.ds_status is ZeroParamStatus.AVAILABLE
            # On the CPU .cpu() is the same tensor, whose storage is freed on exit: clone.
            exported[name] = p.data.cpu().clone()
        whole = pickle.loads(pickle.dumps(params[0]))
        assert torch.equal(whole, reference[named[0][0]])
        assert whole.ds_status is ZeroParamStatus.AVAILABLE
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    assert _to_fetch(params) == params
    for name, value in exported.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)
    # Training gathers and releases through the same transitions.
    x = torch.randn(2, 6)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params)
    engine.destroy()
    assert not any(hasattr(p, "ds_id") or hasattr(p, "ds_status") for p in params)


def _no_attributes_below_stage_3() -> None:
    engine, *_ = zerotrain.initialize(model=_model(), config=_config(2))
    assert not any(hasattr(p, "ds_id") for p in engine.module.parameters())
    assert _to_fetch(list(engine.module.parameters())) == []
    engine.destroy()


def test_stage3_parameters_carry_deepspeed_attributes() -> None:
    run_distributed(_ds_attributes, 2)


def test_no_ds_attributes_below_stage_3() -> None:
    run_distributed(_no_attributes_below_stage_3, 2)


def test_status_is_importable_from_zero() -> None:
    assert zerotrain.zero.ZeroParamStatus is ZeroParamStatus
    assert [s.name for s in ZeroParamStatus] == ["AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"]

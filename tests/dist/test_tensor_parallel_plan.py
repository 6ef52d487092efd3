"""A ``transformers`` Llama-style model made tensor-parallel from its own plan.

A tiny Llama (4 heads, 2 key/value heads: grouped-query attention) is built once, copied,
and the copy is split over 2 ranks with ``parallelize(model, model_tp_plan(model), comm)``:
the vocabulary-parallel embedding, column/row-parallel attention and MLP projections and a
column-parallel head gathering its logits. Its loss equals the dense model's, and every
parameter's gradient equals the dense gradient's slice on this rank (whole parameters such
as the RMSNorm weights: the whole gradient). A glob that matches nothing is an error.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.tensor import tiny_llama
from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.tensor import model_tp_plan, parallelize
from zerotrain.testing.dist import run_distributed

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    return tiny_llama(kv_heads=2)


def _split_dim(dense: torch.Tensor, mine: torch.Tensor) -> int | None:
    for dim, (a, b) in enumerate(zip(dense.shape, mine.shape, strict=True)):
        if a != b:
            return dim
    return None


def _compare() -> dict:
    comm = Communicator()
    dense = _llama()
    model = copy.deepcopy(dense)
    applied = parallelize(model, model_tp_plan(model), comm)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    dense_loss = dense(input_ids=ids, labels=ids).loss
    dense_loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    worst = 0.0
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        full = dense_params[name].grad
        dim = _split_dim(full, param.grad)
        expected = full if dim is None else full.chunk(comm.world_size, dim=dim)[comm.rank]
        worst = max(worst, (param.grad - expected).abs().max().item())
    return {
        "loss": (loss.item(), dense_loss.item()),
        "grad": worst,
        "applied": len(applied),
        "q_proj": tuple(model.model.layers[0].self_attn.q_proj.weight.shape),
    }


def test_llama_from_its_own_plan_equals_the_dense_model():
    for got in run_distributed(_compare, 2, timeout=180):
        mine, dense = got["loss"]
        assert abs(mine - dense) < 1e-5, got
        assert got["grad"] < 1e-5, got
        assert got["applied"] == 2 * 7 + 2  # 7 projections per layer, embedding, head
        assert got["q_proj"] == (16, 32)  # half the heads' rows on each rank


def _typo() -> str:
    comm = Communicator()
    try:
        parallelize(_llama(), {"model.layers.*.self_attn.qproj": "colwise"}, comm)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_glob_matching_nothing_is_an_error():
    message = run_distributed(_typo, 2, timeout=120)[0]
    assert "matches no module" in message, message

"""``zerotrain.zero.Init``: models built without ever holding their parameters whole."""

from __future__ import annotations

import copy
import ctypes
import resource

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.comm.env import init_distributed
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.testing.dist import DistributedTestError, run_distributed

SMALL = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)


class Padded(nn.Module):
    """Initialisation through views, keyword arguments and plain tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6, padding_idx=0)  # weight[0].fill_(0) through a view
        self.norm = nn.Parameter(torch.ones(6) * 2)  # a constant from a real tensor
        self.table = nn.Parameter(torch.arange(12.0).view(2, 6))  # not a constant
        self.lin = nn.Linear(6, 6)
        nn.init.trunc_normal_(self.lin.weight, std=0.1)  # rejection sampling, recorded whole
        with torch.no_grad():
            self.lin.weight.data[:, 0].mul_(3.0)  # reads the previous values
            self.lin.bias.copy_(torch.linspace(0, 1, 6))
        self.qkv = nn.Linear(6, 12)
        for i, piece in enumerate(self.qkv.weight.data.chunk(3)):  # views in a tuple
            nn.init.constant_(piece, float(i))
        own = torch.Generator().manual_seed(5)
        nn.init.normal_(self.qkv.bias, generator=own)  # the user's own generator
        self.copies = nn.ModuleList(copy.deepcopy(self.lin) for _ in range(2))  # clones
        with torch.no_grad():
            self.copies[1].weight.unbind(0)[0].fill_(9.0)
        self.snapshot = nn.Parameter(self.lin.weight.detach().clone())


def _build(kind: str) -> nn.Module:
    if kind == "f64":  # a cast inside Init
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(torch.float64)
    return GPT(SMALL) if kind == "gpt" else Padded()


def _values_from_init(kind: str) -> dict:
    init_distributed()
    torch.manual_seed(1 + dist.get_rank())  # rank 0's seed decides, as without Init
    with zerotrain.zero.Init():
        model = _build(kind)
    assert all(p.is_meta for p in model.parameters())
    after = torch.rand(3)
    config = {
        "train_batch_size": dist.get_world_size(),
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    zerotrain.initialize(model=model, config=config)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "after": after}


@pytest.mark.parametrize("kind", ["gpt", "padded", "f64"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_init_gives_the_values_of_normal_construction_on_every_world_size(kind, world_size):
    torch.manual_seed(1)
    reference = _build(kind)
    rng_after = torch.rand(3)
    results = run_distributed(_values_from_init, world_size, kind)
    for rank, out in enumerate(results):
        for name, value in reference.named_parameters():
            assert torch.equal(out["params"][name], value.detach()), name
        if rank == 0:  # the random stream continues where normal construction leaves it
            assert torch.equal(out["after"], rng_after)


def _values_at_stage0() -> dict:
    torch.manual_seed(1)
    with zerotrain.zero.Init():
        model = GPT(SMALL)
    zerotrain.initialize(model=model, config={"train_batch_size": 2})
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_init_then_a_stage_that_keeps_parameters_whole_materialises_them():
    torch.manual_seed(1)
    reference = GPT(SMALL)
    built = run_distributed(_values_at_stage0, 2)[1]
    for name, value in reference.named_parameters():
        assert torch.equal(built[name], value.detach()), name


class Copies(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)


def _build_copies() -> None:
    try:
        with zerotrain.zero.Init():
            Copies()
    finally:
        assert nn.Parameter(torch.ones(2)).device.type == "cpu"  # the context was undone


class OutKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        with torch.no_grad():
            torch.mul(self.a.weight, 0.5, out=self.a.weight)


def _build_out_keyword() -> None:
    with zerotrain.zero.Init():
        OutKeyword()


def _weight_norm_at_stage3() -> None:
    with zerotrain.zero.Init():
        model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)))
    zerotrain.initialize(
        model=model, config={"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    )


def test_inits_that_cannot_be_replayed_are_refused_with_the_reason():
    with pytest.raises(DistributedTestError, match=r"cannot record .*mul with out="):
        run_distributed(_build_out_keyword, 1)
    with pytest.raises(DistributedTestError, match=r"could not record.*weight_norm"):
        run_distributed(_weight_norm_at_stage3, 1)


def test_an_init_that_reads_another_parameter_is_refused_by_name():
    with pytest.raises(DistributedTestError, match=r"NotImplementedError: .*cannot record .*copy_"):
        run_distributed(_build_copies, 1)


# -- a model larger than one rank's memory ----------------------------------------------------

# 32 blocks of 1.5M parameters: about 190 MB of fp32 parameters.
LARGE = GPTConfig(block_size=16, n_layer=32, n_head=4, n_embd=352, bias=False)
LARGE_BYTES = 4 * 47_700_000
_M_ARENA_MAX, _M_MMAP_THRESHOLD = -8, -3  # glibc mallopt parameters


def _virtual_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _warm_up() -> None:
    """Load what training loads lazily (optimizer and attention code maps tens of MB of
    address space), so the limit below measures the model, not imports."""
    tiny = GPT(SMALL)
    optimizer = torch.optim.SGD(tiny.parameters(), lr=0.1)
    tiny(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    optimizer.step()


def _train_under_limit(use_init: bool) -> str:
    init_distributed()
    _warm_up()
    # RLIMIT_AS counts address space, not memory: glibc reserves 64 MB of it for each
    # thread's malloc arena, and keeps freed heap blocks mapped (resident memory stays flat
    # from step to step, address space does not shrink). One arena, and large blocks mapped
    # separately, keep the limit about memory.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_ARENA_MAX, 1)
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    # This rank may grow its address space by 85% of the full model's fp32 parameters.
    budget = int(0.85 * LARGE_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (_virtual_bytes() + budget, resource.RLIM_INFINITY))
    try:
        return _build_and_train(use_init)
    finally:  # reporting the result starts a thread, which needs address space
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _build_and_train(use_init: bool) -> str:
    torch.manual_seed(0)
    try:
        if use_init:
            with zerotrain.zero.Init():
                model = GPT(LARGE)
        else:
            model = GPT(LARGE)
    except (MemoryError, RuntimeError) as err:
        return f"construction failed: {str(err)[:300]}"
    config = {
        "train_batch_size": dist.get_world_size(),
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1_600_000},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        losses.append(engine.backward(engine(tokens[:, :-1], tokens[:, 1:])).item())
        engine.step()
    return f"trained: {losses}"


@pytest.mark.slow
def test_init_builds_and_trains_a_model_larger_than_each_ranks_memory_limit():
    env = {"ZEROTRAIN_SHM_SLOT_BYTES": str(1 << 20)}  # keep the arena's mapping small
    normal = run_distributed(_train_under_limit, 4, False, env=env, timeout=300)
    assert all(r.startswith("construction failed") for r in normal), normal
    built = run_distributed(_train_under_limit, 4, True, env=env, timeout=300)
    assert all(r.startswith("trained") for r in built), built

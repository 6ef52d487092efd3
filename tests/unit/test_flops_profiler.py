"""zerotrain.profiling in one process: FLOPs against the analytic count of the demo GPT,
per-module consistency, the table, hooks removed on every exit, latency, stage-3-like
released parameters and activation recomputation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.profiling import FlopsProfiler, FlopsProfilerPolicy, FlopsReport, Phase

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
BATCH = 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _profile(model: nn.Module, **kwargs: Any) -> FlopsReport:
    idx, targets = _batch()
    with FlopsProfiler(model, **kwargs) as prof:
        model(idx, targets).backward()
    return prof.report()


@pytest.fixture(scope="module")
def gpt_report() -> tuple[GPT, FlopsReport]:
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, _profile(model)


def _hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def _no_dispatch_mode() -> bool:
    return torch.utils._python_dispatch._get_current_dispatch_mode() is None


# -- (1) totals against the analytic count ------------------------------------------------------


def test_gpt_flops_match_analytic_count(gpt_report: tuple[GPT, FlopsReport]) -> None:
    model, report = gpt_report
    tokens = BATCH * CFG.block_size
    d, t, layers = CFG.n_embd, CFG.block_size, CFG.n_layer
    # Counted FLOPs are matmuls only (embedding lookups, norms, GELU, softmax and the loss are
    # 0). A Linear of weight (out, in) costs 2*in*out per token forward (bias adds are not
    # counted), and 4*in*out backward (grad input + grad weight; every Linear input here needs
    # a gradient). lm_head runs its matmul although its weight is tied to wte, so it counts.
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params == layers * 12 * d * d + d * CFG.vocab_size
    # Attention per layer, forward: QK^T and AV, each 2*T*T*d per sequence. PyTorch counts it
    # dense although the model uses is_causal=True (no halving for the mask), and its backward
    # formula is 2.5x forward (it recomputes QK^T, then 4 matmuls for dS, dV, dQ, dK).
    attn_fwd = layers * BATCH * 2 * (2 * t * t * d)
    assert report.fwd_flops == 2 * tokens * matmul_params + attn_fwd
    assert report.bwd_flops == 4 * tokens * matmul_params + 5 * attn_fwd // 2
    assert report.other_flops == 0  # the loss is computed inside the model
    # The textbook estimate: 6 x matmul params x tokens, plus attention at 3x its forward.
    textbook = 6 * tokens * matmul_params + 3 * attn_fwd
    ratio = (report.fwd_flops + report.bwd_flops) / textbook
    assert ratio == pytest.approx(1.0, abs=0.05), ratio


def test_total_agrees_with_plain_flop_counter_mode() -> None:
    # FlopCounterMode alone on a model without attention (nothing for our CPU formulas to add).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(5, 16)
    with FlopCounterMode(display=False) as plain:
        model(x).sum().backward()
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
    report = prof.report()
    # The first layer's input needs no gradient: forward + weight gradient only (2x, not 3x).
    assert report.flops == plain.get_total_flops() == 2 * 5 * (2 * 16 * 32 + 3 * 32 * 8)


# -- (2) per-module numbers ---------------------------------------------------------------------


def test_children_sum_to_at_most_their_parent(gpt_report: tuple[GPT, FlopsReport]) -> None:
    model, report = gpt_report
    by_name = {p.name: p for p in report.modules}
    for name, module in model.named_modules():
        children = [by_name[f"{name}.{c}" if name else c] for c, _ in module.named_children()]
        if not children:
            continue
        parent = by_name[name]
        assert sum(c.fwd_flops for c in children) <= parent.fwd_flops, name
        assert sum(c.bwd_flops for c in children) <= parent.bwd_flops, name
    # A block's FLOPs are all in its attention and MLP; attention adds the sdpa matmuls.
    tokens, d, t = BATCH * CFG.block_size, CFG.n_embd, CFG.block_size
    block, attn, mlp = by_name["blocks.0"], by_name["blocks.0.attn"], by_name["blocks.0.mlp"]
    assert block.flops == attn.flops + mlp.flops
    qkv, proj = by_name["blocks.0.attn.qkv"], by_name["blocks.0.attn.proj"]
    assert qkv.fwd_flops == 2 * tokens * d * 3 * d
    assert qkv.bwd_flops == 2 * qkv.fwd_flops
    assert attn.fwd_flops == qkv.fwd_flops + proj.fwd_flops + BATCH * 4 * t * t * d
    # A ModuleList is never called: it shows the sum of its blocks.
    blocks = by_name["blocks"]
    assert blocks.calls == 0
    assert blocks.flops == sum(by_name[f"blocks.{i}"].flops for i in range(CFG.n_layer))
    assert by_name[""].fwd_flops == report.fwd_flops


def test_params_per_module(gpt_report: tuple[GPT, FlopsReport]) -> None:
    model, report = gpt_report
    for name, module in model.named_modules():
        expected = sum(p.numel() for p in module.parameters())  # distinct: tied counted once
        assert report.module(name).params == expected, name
    assert report.total_params == model.num_parameters()
    assert report.module("lm_head").params == CFG.vocab_size * CFG.n_embd  # the tied weight
    assert [p.depth for p in report.modules[:3]] == [0, 1, 1]
    with pytest.raises(KeyError, match="nope"):
        report.module("nope")


class _Released(nn.Module):
    """A stage-3-like linear: its weight has 0 elements except inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self._full = {n: p.detach().clone() for n, p in self.lin.named_parameters()}
        # Registered before the profiler's hooks, as the engine's are: gather, then release.
        self.lin.register_forward_pre_hook(lambda *_: self._swap(full=True))
        self.lin.register_forward_hook(lambda *_: self._swap(full=False))
        self._swap(full=False)

    def _swap(self, full: bool) -> None:
        for name, param in self.lin.named_parameters():
            param.data = self._full[name] if full else torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_params_of_released_parameters_are_measured_in_forward() -> None:
    model = _Released()
    assert sum(p.numel() for p in model.parameters()) == 0
    with FlopsProfiler(model) as prof:
        model(torch.randn(3, 8))
    assert prof.report().total_params == 8 * 4 + 4
    assert prof.report().module("lin").params == 8 * 4 + 4


def test_param_numel_override() -> None:
    model = _Released()
    with FlopsProfiler(model, param_numel={"lin.weight": 1000}) as prof:
        model(torch.randn(3, 8))
    assert prof.report().total_params == 1000 + 4
    # Never called: without an override a released parameter counts 0, with one its full size.
    with FlopsProfiler(model, param_numel={"lin.weight": 32, "lin.bias": 4}) as prof:
        pass
    assert prof.report().total_params == 36


def test_activation_recomputation_counts_as_backward() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
            return out

    x = torch.randn(4, 16, requires_grad=True)
    # Without early stop the whole checkpointed forward is recomputed (with it, torch stops
    # once the saved tensors it needs are back, here after the first Linear).
    with FlopsProfiler(Wrapped()) as prof, set_checkpoint_early_stop(False):
        prof.model(x).sum().backward()
    report = prof.report()
    fwd = 2 * 4 * 16 * 16 * 2
    assert report.fwd_flops == fwd
    assert report.bwd_flops == 2 * fwd + fwd  # gradients, plus the recomputed forward
    assert report.module("inner").calls == 1  # the recomputation is not a forward call


# -- (3) the table ------------------------------------------------------------------------------


def test_table_rows_and_depth(gpt_report: tuple[GPT, FlopsReport]) -> None:
    _, report = gpt_report
    full = report.table()
    for row in ("params", "fwd FLOPs", "bwd FLOPs", "fwd+bwd FLOPs", "step latency"):
        assert f"  {row} " in full
    assert "achieved FLOP/s" in full
    assert "Per-module profile" in full
    for row in ("GPT", "blocks (ModuleList)", "0 (Block)", "attn (CausalSelfAttention)"):
        assert row in full
    assert "        qkv (Linear)" in full  # depth 4: indented 8 spaces

    shallow = report.table(module_depth=1)
    assert "blocks (ModuleList)" in shallow
    assert "lm_head (Linear)" in shallow
    assert "(Block)" not in shallow
    assert "qkv (Linear)" not in shallow

    brief = report.table(detailed=False)
    assert "Per-module profile" not in brief
    assert "(CausalSelfAttention)" not in brief


def test_table_top_modules_per_depth(gpt_report: tuple[GPT, FlopsReport]) -> None:
    _, report = gpt_report

    def top_rows(text: str) -> list[list[str]]:
        section = text.split("\n\n")[1].splitlines()[2:]  # past the title and the header
        return [line.split() for line in section]

    one = top_rows(report.table(top_modules=1, detailed=False))
    assert [row[0] for row in one] == ["0", "1", "2", "3", "4"]
    # Depth 2 holds the blocks only; depth 3 the MLPs cost more than the attentions (at T=32).
    assert one[2][1:3] == ["Block", f"x{CFG.n_layer}"]
    assert one[3][1] == "MLP"
    two = top_rows(report.table(module_depth=3, top_modules=2, detailed=False))
    assert [row[0] for row in two] == ["0", "1", "1", "2", "3", "3"]
    assert [row[1] for row in two[3:]] == ["Block", "MLP", "CausalSelfAttention"]


def test_table_rejects_bad_arguments(gpt_report: tuple[GPT, FlopsReport]) -> None:
    _, report = gpt_report
    with pytest.raises(ValueError, match="module_depth"):
        report.table(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules"):
        report.table(top_modules=0)


# -- (4) nothing left installed -----------------------------------------------------------------


def test_hooks_removed_after_exit() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    before = _hook_counts(model)
    _profile(model)
    assert _hook_counts(model) == before
    assert _no_dispatch_mode()


def test_hooks_removed_after_exception_in_block() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    before = _hook_counts(model)
    idx, targets = _batch()
    prof = FlopsProfiler(model)
    kept: list[torch.Tensor] = []

    def fail_inside() -> None:
        with prof:
            kept.append(model(idx, targets))  # hooks now wait on this graph's gradients
            raise ZeroDivisionError("inside the profiled block")

    with pytest.raises(ZeroDivisionError):
        fail_inside()
    assert _hook_counts(model) == before
    assert _no_dispatch_mode()
    assert prof.phase is Phase.IDLE
    with pytest.raises(RuntimeError, match="no completed profile"):
        prof.report()
    kept[0].backward()  # the graph built while profiling runs without the profiler
    # and the profiler can be used again.
    report = _profile(model)
    assert report.flops > 0


def test_hooks_removed_after_exception_in_forward() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Broken())
    before = _hook_counts(model)
    with pytest.raises(RuntimeError, match="boom"), FlopsProfiler(model):
        model(torch.randn(2, 4))
    assert _hook_counts(model) == before
    assert _no_dispatch_mode()


def test_start_stop_lifecycle() -> None:
    model = nn.Linear(4, 4)
    prof = FlopsProfiler(model)
    with pytest.raises(RuntimeError, match="not profiling"):
        prof.stop()
    prof.start()
    with pytest.raises(RuntimeError, match="already profiling"):
        prof.start()
    with pytest.raises(RuntimeError, match="no completed profile"):
        prof.report()
    model(torch.randn(3, 4))
    prof.stop()
    assert prof.phase is Phase.DONE
    assert prof.report().fwd_flops == 2 * 3 * 4 * 4
    assert _hook_counts(model) == [(0, 0)]


# -- (5) latency --------------------------------------------------------------------------------


def test_latency_is_positive(gpt_report: tuple[GPT, FlopsReport]) -> None:
    _, report = gpt_report
    assert report.step_latency_s > 0
    assert report.flops_per_s > 0
    for profile in report.modules:
        assert profile.fwd_latency_s > 0, profile.name
    root = report.module("")
    assert root.fwd_latency_s <= report.step_latency_s
    assert report.module("blocks.0.mlp.fc").fwd_flops_per_s > 0


# -- policy -------------------------------------------------------------------------------------


def test_policy_defaults_and_validation() -> None:
    policy = FlopsProfilerPolicy()
    assert (policy.enabled, policy.profile_step, policy.module_depth) == (False, 1, -1)
    assert (policy.top_modules, policy.detailed, policy.output_file) == (1, True, None)
    with pytest.raises(ValueError, match="profile_step"):
        FlopsProfilerPolicy(profile_step=0)
    with pytest.raises(ValueError, match="module_depth"):
        FlopsProfilerPolicy(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules"):
        FlopsProfilerPolicy(top_modules=0)

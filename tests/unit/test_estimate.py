"""The memory estimator without processes: formulas per stage, parsing, the fit search,
the CLI and its error messages."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zerotrain.cli.main import main
from zerotrain.estimate import (
    TransformerShape,
    estimate_memory,
    gpt_activation_bytes,
    largest_model_that_fits,
    parse_bytes,
    parse_count,
)
from zerotrain.examples.gpt import GPT, GPTConfig

GIB = 2**30


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("7e9", 7_000_000_000),
        ("1.3B", 1_300_000_000),
        ("350M", 350_000_000),
        ("125k", 125_000),
        ("7,000,000", 7_000_000),
        ("42", 42),
    ],
)
def test_parse_count(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * GIB),
        ("80GB", 80 * 10**9),
        ("80G", 80 * GIB),
        ("512MiB", 512 * 2**20),
        ("1024", 1024),
    ],
)
def test_parse_bytes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["seven", "7X", "-3", "0"])
def test_parse_count_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match="parameter count"):
        parse_count(text)


def test_parse_bytes_rejects_unknown_unit() -> None:
    with pytest.raises(ValueError, match="unknown unit 'QB'"):
        parse_bytes("3QB")


@pytest.mark.parametrize(
    ("stage", "dtype", "per_param"),
    # The ZeRO paper's bytes per parameter at N ranks, Adam: fp32 has no master copy.
    [
        (0, "fp32", lambda n: 16),
        (1, "fp32", lambda n: 8 + 8 / n),
        (2, "fp32", lambda n: 4 + 12 / n),
        (3, "fp32", lambda n: 16 / n),
        (0, "bf16", lambda n: 2 + 4 + 12),
        (1, "bf16", lambda n: 2 + 4 + 12 / n),
        (2, "bf16", lambda n: 2 + 16 / n),
        (3, "bf16", lambda n: 18 / n),
    ],
)
def test_count_only_follows_the_zero_formulas(stage: int, dtype: str, per_param) -> None:
    # bf16 accumulates gradients in fp32 by default: 4 bytes of gradient, not the paper's 2.
    n, psi = 4, 64 * 10**6
    est = estimate_memory(psi, world_size=n, stage=stage, dtype=dtype)
    assert est.model_state_bytes == pytest.approx(per_param(n) * psi, rel=1e-6)


def test_bf16_gradients_in_bf16_are_the_papers_two_bytes() -> None:
    est = estimate_memory(10**6, world_size=1, stage=0, dtype="bf16", grad_accum_dtype="bf16")
    assert est.grads.device == 2 * 10**6


def test_module_shapes_reproduce_padding() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))  # 12 each
    # Stage 3 at N=5: each unit of 12 elements pads to 15, rank 0 keeps 3 of each.
    est = estimate_memory(model, world_size=5, stage=3, device="cpu")
    assert est.params.device == 2 * 3 * 4
    assert est.padding_elements == 2 * 3


def test_offload_moves_optimizer_states_and_params() -> None:
    kw = {"world_size": 8, "stage": 3, "dtype": "bf16"}
    plain = estimate_memory(10**9, **kw)
    # On a GPU: moments and master to the host; parameter shards are not moved yet.
    off = estimate_memory(10**9, offload_optimizer="cpu", offload_param="cpu", **kw)
    steps = 4 * plain.units  # one step count per piece stays as it is, in host memory
    assert off.optimizer_states.cpu == plain.optimizer_states.device
    assert off.optimizer_states.device == 0
    assert off.master_weights.cpu == plain.master_weights.device
    assert off.params.device == plain.params.device
    assert off.grads.device == plain.grads.device
    assert steps > 0
    # NVMe on a CPU run: moments, master and gradient slices to files; parameter shards too
    # beyond max_in_cpu.
    cpu_plain = estimate_memory(10**9, device="cpu", **kw)
    nvme = estimate_memory(
        10**9, device="cpu", offload_optimizer="nvme", offload_param="nvme", max_in_cpu=0, **kw
    )
    assert nvme.master_weights.nvme == cpu_plain.master_weights.device
    assert nvme.grads.nvme == cpu_plain.grads.device
    assert nvme.params.nvme + nvme.params.device == cpu_plain.params.device
    assert nvme.params.device < cpu_plain.params.device / 100
    assert nvme.optimizer_states.device == steps
    assert nvme.total < cpu_plain.total / 5  # the gathered working set and staging remain
    kept = estimate_memory(10**9, device="cpu", offload_param="nvme", **kw)
    assert kept.params.nvme == 0  # max_in_cpu 1e9 keeps a 1B model's shards in memory
    with pytest.raises(ValueError, match="CPU runs only"):
        estimate_memory(10**9, offload_param="nvme", **kw)


def test_activations_of_a_gpt() -> None:
    shape = TransformerShape(layers=2, hidden=8, heads=2, vocab=16)
    act = gpt_activation_bytes(shape, micro_batch=3, seq_len=5, dtype_bytes=4)
    tokens = 15
    per_layer = 16 * 8 * 4 + (4 + 2) * 4
    assert act.saved == tokens * (2 * per_layer + 2 * 8 * 4 + 8 + 16 * 4)
    assert act.transient == tokens * (16 + 64) * 4


def test_gpt_config_is_read_for_activations() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    est = estimate_memory(model, world_size=1, stage=0, micro_batch=2, seq_len=16)
    assert est.activations.device > 0
    assert est.num_params == model.num_parameters()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fit_search_is_monotone_and_tight(stage: int) -> None:
    kw = {"world_size": 8, "stage": stage, "dtype": "bf16"}
    fits = [largest_model_that_fits(m * GIB, **kw) for m in (8, 16, 24, 40, 80)]
    assert fits == sorted(fits)
    assert fits[0] > 0
    best = fits[-1]
    assert estimate_memory(best, **kw).total <= 80 * GIB < estimate_memory(best + 1, **kw).total


def test_fit_is_zero_when_activations_alone_overflow() -> None:
    shape = TransformerShape(layers=96, hidden=12288, heads=96, vocab=50257)
    fits = largest_model_that_fits(
        GIB, world_size=8, stage=3, micro_batch=8, seq_len=4096, transformer=shape
    )
    assert fits == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 5}, "stage must be 0, 1, 2 or 3, got 5"),
        ({"world_size": 0}, "world_size must be >= 1, got 0"),
        ({"dtype": "fp8"}, "dtype must be one of fp32, bf16, fp16, got 'fp8'"),
        ({"offload_optimizer": "disk"}, "offload_optimizer must be one of none, cpu, nvme"),
        ({"offload_param": "cpu"}, "offload_param needs ZeRO stage 3"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer needs ZeRO stage 1"),
        ({"grad_accum_dtype": "bf16"}, "grad_accum_dtype 'bf16' is not allowed"),
        ({"micro_batch": 4}, "activations need both micro_batch and seq_len"),
        ({"optimizer": "adagrad"}, "optimizer must be one of"),
    ],
)
def test_invalid_configuration_is_named(kwargs: dict, message: str) -> None:
    options = {"world_size": 2, "stage": 2, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        estimate_memory(10**6, **options)


def test_cli_prints_table_and_fit(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "estimate",
            "--params",
            "1.3B",
            "--world-size",
            "4",
            "--stage",
            "2",
            "--dtype",
            "bf16",
            "--memory",
            "24GiB",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("params", "grads", "master_weights", "optimizer_states", "total"):
        assert word in out
    assert "1,300,000,000 parameters" in out
    assert "largest model that fits:" in out


@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    source = textwrap.dedent(
        """
        from zerotrain.examples.gpt import GPT, GPTConfig

        def build():
            return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32))

        def layers():
            from zerotrain.examples.gpt import gpt_pipeline_layers

            return gpt_pipeline_layers(GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=32))

        def not_a_model():
            return 3

        NOT_CALLABLE = 1
        """
    )
    (tmp_path / "est_model_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "est_model_mod"
    sys.modules.pop("est_model_mod", None)


def test_cli_model_factory_on_meta(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "estimate",
            "--model",
            f"{model_file}:build",
            "--world-size",
            "2",
            "--stage",
            "3",
            "--micro-batch",
            "4",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--memory",
            "1GiB",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "activations" in out
    assert "shapes assumed" not in out


def test_cli_3d_layout_estimates_the_ranks_piece(
    model_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 5 of pipe 2 x data 1 x sequence 2 x tensor 2: stage 1's blocks, half of each
    split layer, sharded over its 2 sequence ranks (exactness: test_estimate_vs_breakdown)."""
    common = ["estimate", "--model", f"{model_file}:layers", "--stage", "2", "--device", "cpu"]
    layout = ["--world-size", "8", "--pp", "2", "--tp", "2", "--sp", "2", "--tp-preset", "gpt"]
    assert main([*common, *layout, "--rank", "5", "--memory", "1GiB"]) == 0
    piece = capsys.readouterr().out
    assert main([*common, "--world-size", "1", "--memory", "1GiB"]) == 0  # one stage: fine
    capsys.readouterr()
    assert "world size 2" in piece, piece  # the ZeRO group: data x sequence
    whole = int(piece.split("zerotrain estimate: ")[1].split(" parameters")[0].replace(",", ""))
    assert 0 < whole < 70_000, piece  # the whole model has ~140k


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "1B", "--world-size", "2", "--stage", "5"], "stage must be 0, 1, 2 or 3"),
        (["--params", "1B", "--world-size", "0", "--stage", "1"], "world size 0"),
        (
            ["--params", "1B", "--world-size", "6", "--stage", "1", "--tp", "4"],
            "not divisible by pipe 1 x tensor 4",
        ),
        (
            ["--model", "{mod}:build", "--world-size", "4", "--stage", "1", "--pp", "2"],
            "returning the pipeline layer list",
        ),
        (
            ["--params", "1B", "--world-size", "2", "--stage", "1", "--dtype", "int8"],
            "--dtype must be one of fp32, bf16, fp16",
        ),
        (["--params", "lots", "--world-size", "2", "--stage", "1"], "is not a number"),
        (["--model", "nocolon", "--world-size", "2", "--stage", "1"], "expected module:factory"),
        (["--model", "no_such_module_xyz:f", "--world-size", "2", "--stage", "1"], "cannot import"),
        (["--model", "{mod}:missing", "--world-size", "2", "--stage", "1"], "has no attribute"),
        (["--model", "{mod}:NOT_CALLABLE", "--world-size", "2", "--stage", "1"], "is not callable"),
        (["--model", "{mod}:not_a_model", "--world-size", "2", "--stage", "1"], "not an nn.Module"),
        (
            ["--params", "1B", "--world-size", "2", "--stage", "1", "--offload-param", "cpu"],
            "offload_param needs ZeRO stage 3",
        ),
    ],
)
def test_cli_errors_are_clear(
    argv: list[str], message: str, model_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{mod}", model_file) for a in argv]
    rc = main(["estimate", *argv, "--memory", "1GiB"])
    assert rc == 2
    assert message in capsys.readouterr().err

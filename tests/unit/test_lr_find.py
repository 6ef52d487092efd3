"""``zerotrain lr-find``'s pieces without a job: the request that travels to the ranks, the
schedule it imposes (checked against DeepSpeed's LRRangeTest as zerotrain builds it), the
config override ``initialize`` applies, the command's sweep arithmetic and its report."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch

from zerotrain.cli import lr_find as cli
from zerotrain.cli.main import build_parser
from zerotrain.config.loader import load_config
from zerotrain.engine.lr_find import ENV_VAR, LRFindRequest, LRRangeTestFinished, read_records
from zerotrain.optim.cyclic_schedules import LRRangeTest

CONFIG = {
    "train_batch_size": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
}


def _request(**overrides: object) -> LRFindRequest:
    fields: dict[str, object] = {"min_lr": 1e-4, "step_rate": 3.0, "max_steps": 20}
    return LRFindRequest(**{**fields, **overrides})


def test_request_travels_through_one_environment_variable():
    request = _request(staircase=True, step_size=3, record_path="/tmp/x.jsonl")
    env = request.to_env()
    assert list(env) == [ENV_VAR]
    assert LRFindRequest.from_env(env) == request
    assert LRFindRequest.from_env({}) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not JSON"),
        ('{"min_lr": 1e-4, "step_rate": 1, "lr": 3}', r"keys among .*got \['lr'\]"),
        ("[1, 2]", "must be a JSON object"),
        ('{"step_rate": 1}', "missing 1 required positional argument: 'min_lr'"),
        ('{"min_lr": -1, "step_rate": 1, "max_steps": 0}', "min_lr must be positive.*max_steps"),
    ],
)
def test_a_bad_request_names_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        LRFindRequest.from_env({ENV_VAR: value})


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_at_is_the_lr_range_test_schedule_the_engine_runs(staircase):
    request = _request(step_size=3, staircase=staircase)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = LRRangeTest(opt, **request.scheduler_section()["params"])
    for step in range(1, 21):  # the engine steps the schedule after each optimizer step
        assert opt.param_groups[0]["lr"] == pytest.approx(request.lr_at(step), rel=1e-15)
        interval = (step - 1) // 3 if staircase else (step - 1) / 3
        assert request.lr_at(step) == pytest.approx(1e-4 * (1 + 3.0 * interval), rel=1e-15)
        schedule.step()


def test_apply_replaces_the_scheduler_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        raw = _request().apply(CONFIG)
    assert "scheduler (WarmupLR) is replaced by LRRangeTest" in caplog.text
    assert CONFIG["scheduler"]["type"] == "WarmupLR"  # the caller's dict is not changed
    assert raw["optimizer"] == CONFIG["optimizer"]
    cfg = load_config(raw)
    assert cfg.scheduler is not None
    assert cfg.scheduler.type == "LRRangeTest"
    assert cfg.scheduler.params == {
        "lr_range_test_min_lr": 1e-4,
        "lr_range_test_step_size": 1,
        "lr_range_test_step_rate": 3.0,
        "lr_range_test_staircase": False,
    }


def test_override_takes_every_kind_of_config_source(tmp_path):
    request = _request()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    no_scheduler = {k: v for k, v in CONFIG.items() if k != "scheduler"}
    for source in (CONFIG, str(path), load_config(CONFIG), no_scheduler):
        cfg = load_config(request.override(source))
        assert cfg.scheduler is not None
        assert cfg.scheduler.type == "LRRangeTest"
        assert cfg.scheduler.params["lr_range_test_step_rate"] == 3.0
        assert cfg.optimizer is not None
        assert cfg.optimizer.params["lr"] == 1e-3
    with pytest.raises(ValueError, match=r"passed lr_scheduler= to zerotrain\.initialize"):
        request.override(CONFIG, lr_scheduler=object())


def test_finished_is_a_successful_exit_with_a_message():
    finished = LRRangeTestFinished("done at step 3")
    assert isinstance(finished, SystemExit)
    assert finished.code == 0
    assert str(finished) == "done at step 3"


def _cli_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["lr-find", *argv, "train.py", "--config", "ds.json"])


def test_the_command_picks_the_step_rate_that_ends_at_max_lr(tmp_path):
    args = _cli_args("--min-lr", "1e-6", "--max-lr", "0.5", "--steps", "40")
    assert args.script_args == ["--config", "ds.json"]
    request = cli.make_request(args, tmp_path / "r.jsonl")
    assert request.step_size == 1
    assert request.lr_at(1) == 1e-6
    assert request.lr_at(40) == pytest.approx(0.5, rel=1e-12)
    stairs = cli.make_request(
        _cli_args("--max-lr", "1e-2", "--steps", "50", "--step-size", "10", "--staircase"),
        tmp_path / "r.jsonl",
    )
    assert stairs.lr_at(41) == stairs.lr_at(50) == pytest.approx(1e-2, rel=1e-12)
    assert stairs.lr_at(40) < 1e-2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-lr", "1e-2", "--max-lr", "1e-3"], "need 0 < min < max"),
        (["--steps", "1"], "need --steps > 1"),
        (["--steps", "10", "--step-size", "10", "--staircase"], "> --step-size 10"),
    ],
)
def test_the_command_refuses_a_sweep_that_cannot_rise(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.make_request(_cli_args(*argv), tmp_path / "r.jsonl")


def test_report_without_records_says_how_to_train(tmp_path):
    request = _request(record_path=str(tmp_path / "none.jsonl"))
    code, lines = cli.report(request, tmp_path, returncode=0)
    assert code == 1
    assert "zerotrain.initialize" in lines[0]
    assert "engine.step()" in lines[0]
    code, lines = cli.report(request, tmp_path, returncode=1)
    assert code == 1
    assert "failed before its first optimizer step" in lines[0]


def test_report_writes_records_suggestion_and_a_onecycle_section(tmp_path):
    request = _request(record_path=str(tmp_path / "r.jsonl"), max_steps=8)
    losses = [3.0, 2.5, 2.0, 1.5, 1.2, 1.1, 3.0, 9.0]
    lines = [{"step": k + 1, "lr": request.lr_at(k + 1), "loss": x} for k, x in enumerate(losses)]
    lines.append({"stopped": "LR range test finished at step 8 (lr 0.0022): diverged"})
    Path(request.record_path).write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, stopped = read_records(request.record_path)
    assert [r.loss for r in records] == losses
    assert stopped is not None
    code, printed = cli.report(request, tmp_path, returncode=0, plot=False)
    assert code == 0, printed
    result = json.loads((tmp_path / cli.RESULT).read_text())
    assert [r["loss"] for r in result["records"]] == losses
    assert result["request"]["step_rate"] == 3.0
    suggestion = result["suggestion"]
    assert result["scheduler"]["type"] == "OneCycle"
    assert result["scheduler"]["params"]["cycle_max_lr"] == float(f"{suggestion['max_lr']:.3g}")
    text = "\n".join(printed)
    assert '"cycle_min_lr"' in text
    assert "suggested lr range" in text

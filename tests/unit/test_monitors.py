"""Monitors: series written to TensorBoard, CSV and wandb (offline) and read back from disk."""

from __future__ import annotations

import csv
import json
import math
import re
import struct
import sys
import time
from pathlib import Path

import pytest

from zerotrain.monitor import (
    CSV_HEADER,
    CsvMonitor,
    Event,
    Monitor,
    MonitorKind,
    MonitorPolicy,
    Monitors,
    TensorBoardMonitor,
    WandbMonitor,
    check_dependency,
    checked_events,
    csv_file_name,
    import_dependency,
    memory_tag,
    tags,
)

MISSING = "zerotrain_test_module_that_does_not_exist"


def _series(steps: int = 3, ranks: int = 2) -> list[list[Event]]:
    """A few optimizer steps of every series the engine logs; step = samples seen.

    Values are exact in float32 because TensorBoard stores scalars as float32.
    """
    out = []
    for i in range(steps):
        samples = 8 * (i + 1)
        step = [
            (tags.TRAIN_LOSS, 2.0 - 0.25 * i, samples),
            (tags.LEARNING_RATE, 0.5**i, samples),
            (tags.LOSS_SCALE, 2.0**16, samples),
            (tags.GRAD_NORM, 1.5 + i, samples),
            (tags.SAMPLES_PER_SEC, 100.0 + i, samples),
        ]
        step += [(memory_tag(r), 512.0 + 64 * r + i, samples) for r in range(ranks)]
        out.append(step)
    return out


def _expected(series: list[list[Event]]) -> dict[str, list[tuple[int, float]]]:
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for step in series:
        for tag, value, s in step:
            by_tag.setdefault(tag, []).append((s, value))
    return by_tag


def _read_csv_dir(folder: Path) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for path in sorted(folder.glob("*.csv")):
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        assert tuple(rows[0]) == CSV_HEADER
        out[path.name] = [(int(s), float(v)) for s, v in rows[1:]]
    return out


def _read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list[bytes]:
    """Payloads of a ``.wandb`` file: wandb's LevelDB-style log (7-byte file header, then
    32 KiB blocks of records with a crc32/length/type header); wandb no longer ships a
    Python reader for it."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer too short for a header: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += payload
        if kind in (1, 4):  # FULL or LAST closes a record; FIRST/MIDDLE continue it
            out.append(pending)
            pending = b""
    return out


def _read_wandb(run_dir: Path) -> tuple[dict[str, str | None], dict[str, list[tuple[int, float]]]]:
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = run_dir.glob("run-*.wandb")
    # wandb's service process writes the file asynchronously: run.finish() can return while
    # it still holds only its header. Wait for the run's closing "exit" record.
    deadline = time.monotonic() + 60
    while True:
        records = []
        for payload in _wandb_records(log):
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{log} has no exit record after 60 s"
        time.sleep(0.1)
    run: dict[str, str | None] = {}
    history: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = {"project": r.project, "group": r.run_group, "name": r.display_name}
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    history.setdefault(key, []).append((step, json.loads(item.value_json)))
    return run, history


# --- policies, tags, events -------------------------------------------------------------


def test_memory_tag_names_one_series_per_rank():
    assert memory_tag(1) == "Train/Memory/rank1_peak_rss_MiB"
    assert memory_tag(0, tags.DEVICE_PEAK_ALLOCATED_MIB) == (
        "Train/Memory/rank0_device_peak_allocated_MiB"
    )
    assert memory_tag(3).startswith(tags.MEMORY_PREFIX)
    with pytest.raises(ValueError, match="rank"):
        memory_tag(-1)
    with pytest.raises(ValueError, match="metric"):
        memory_tag(0, "a/b")


def test_policy_validation_names_the_field_and_value():
    policy = MonitorPolicy(MonitorKind.CSV, output_path="out", job_name="job")
    assert policy.log_dir == Path("out") / "job"
    assert MonitorPolicy(MonitorKind.CSV, job_name="job").log_dir == Path("job")
    with pytest.raises(TypeError, match="MonitorKind"):
        MonitorPolicy("csv_monitor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"csv_monitor\.job_name"):
        MonitorPolicy(MonitorKind.CSV, job_name="")
    with pytest.raises(ValueError, match="'sometimes'"):
        MonitorPolicy(MonitorKind.WANDB, mode="sometimes")


def test_events_are_checked_and_values_converted():
    assert checked_events([("a", 1, 2)]) == [("a", 1.0, 2)]
    nan = checked_events([("loss", float("nan"), 0)])[0][1]
    assert math.isnan(nan)  # a diverging loss must still be logged
    with pytest.raises(TypeError, match="expected"):
        checked_events([("a", 1.0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="step must be an int"):
        checked_events([("a", 1.0, True)])
    with pytest.raises(TypeError, match="not a number"):
        checked_events([("a", "x", 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=">= 0"):
        checked_events([("a", 1.0, -1)])
    with pytest.raises(ValueError, match="empty"):
        checked_events([("", 1.0, 1)])


# --- missing packages -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "package"), [(MonitorKind.TENSORBOARD, "tensorboard"), (MonitorKind.WANDB, "wandb")]
)
def test_missing_package_error_says_what_to_install(kind, package):
    for check in (check_dependency, import_dependency):
        with pytest.raises(ImportError) as info:
            check(kind, MISSING)
        message = str(info.value)
        assert f"pip install {package}" in message
        assert f"zerotrain[{package}]" in message
        assert MISSING in message
        assert kind.value in message
    check_dependency(MonitorKind.CSV)  # needs nothing


@pytest.mark.parametrize("kind", [MonitorKind.TENSORBOARD, MonitorKind.WANDB])
def test_missing_package_fails_at_construction_on_every_rank(tmp_path, monkeypatch, kind):
    # A None entry in sys.modules is Python's documented way to make an import fail.
    monkeypatch.setitem(sys.modules, str(kind.package), None)
    policy = MonitorPolicy(kind, output_path=str(tmp_path), job_name="job", mode="offline")
    backend = TensorBoardMonitor if kind is MonitorKind.TENSORBOARD else WandbMonitor
    with pytest.raises(ImportError, match=f"pip install {kind.package}"):
        backend(policy)
    for rank in (0, 1):  # rank 1 fails too, rather than waiting for rank 0 in a collective
        with pytest.raises(ImportError, match=re.escape(f"zerotrain[{kind.package}]")):
            Monitors([policy], rank=rank)
    assert not (tmp_path / "job").exists()
    # Disabled, it is not needed.
    disabled = MonitorPolicy(kind, enabled=False, output_path=str(tmp_path))
    assert not Monitors([disabled], rank=0).configured


# --- CSV --------------------------------------------------------------------------------


def test_csv_round_trip_one_file_per_series(tmp_path):
    policy = MonitorPolicy(MonitorKind.CSV, output_path=str(tmp_path), job_name="job")
    monitor = CsvMonitor(policy)
    assert isinstance(monitor, Monitor)
    series = _series()
    for step in series:
        monitor.write(step)
    # Read back before close: every write is already on disk.
    got = _read_csv_dir(tmp_path / "job")
    expected = {csv_file_name(t): rows for t, rows in _expected(series).items()}
    assert got == expected
    assert "Train_Samples_train_loss.csv" in got
    assert "Train_Memory_rank1_peak_rss_MiB.csv" in got
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.write(series[0])


def test_csv_resumed_run_appends_without_a_second_header(tmp_path):
    policy = MonitorPolicy(MonitorKind.CSV, output_path=str(tmp_path), job_name="job")
    first = CsvMonitor(policy)
    first.write([(tags.TRAIN_LOSS, 1.0, 8)])
    first.close()
    second = CsvMonitor(policy)
    second.write([(tags.TRAIN_LOSS, 0.5, 16), (tags.TRAIN_LOSS, 0.1 + 0.2, 24)])
    second.close()
    rows = _read_csv_dir(tmp_path / "job")["Train_Samples_train_loss.csv"]
    assert rows == [(8, 1.0), (16, 0.5), (24, 0.1 + 0.2)]  # exact float round trip


def test_csv_refuses_two_tags_in_one_file(tmp_path):
    monitor = CsvMonitor(MonitorPolicy(MonitorKind.CSV, output_path=str(tmp_path)))
    monitor.write([("a/b", 1.0, 0)])
    with pytest.raises(ValueError, match=r"both map to file a_b\.csv"):
        monitor.write([("a_b", 2.0, 0)])


# --- TensorBoard ------------------------------------------------------------------------


def test_tensorboard_round_trip_through_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    policy = MonitorPolicy(MonitorKind.TENSORBOARD, output_path=str(tmp_path), job_name="job")
    monitor = TensorBoardMonitor(policy)
    assert isinstance(monitor, Monitor)
    series = _series()
    for step in series:
        monitor.write(step)
    # Flushed by write: readable while the writer is still open.
    assert _read_tensorboard(tmp_path / "job") == _expected(series)
    assert list((tmp_path / "job").glob("events.out.tfevents.*"))
    monitor.close()
    monitor.close()
    with pytest.raises(RuntimeError, match="closed"):
        monitor.write(series[0])


# --- wandb ------------------------------------------------------------------------------


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Keep wandb off the network and away from the user's settings and home folder."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.mark.usefixtures("wandb_env")
def test_wandb_offline_run_holds_the_series(tmp_path):
    policy = MonitorPolicy(
        MonitorKind.WANDB,
        output_path=str(tmp_path),
        job_name="job",
        project="proj",
        group="grp",
        mode="offline",
    )
    monitor = WandbMonitor(policy)
    assert isinstance(monitor, Monitor)
    run_dir = monitor.run_dir
    assert run_dir is not None
    assert run_dir.parent == tmp_path / "job" / "wandb"
    assert run_dir.name.startswith("offline-run-")
    series = _series()
    for step in series:
        monitor.write(step)
    monitor.close()
    monitor.close()
    assert monitor.run_dir is None
    with pytest.raises(RuntimeError, match="closed"):
        monitor.write(series[0])

    run, history = _read_wandb(run_dir)
    assert run == {"project": "proj", "group": "grp", "name": "job"}
    assert history == _expected(series)


# --- fan-out ----------------------------------------------------------------------------


def _all_policies(root: Path, *, wandb: bool) -> list[MonitorPolicy]:
    out = str(root / "runs")
    policies = [
        MonitorPolicy(MonitorKind.TENSORBOARD, output_path=out, job_name="tb"),
        MonitorPolicy(MonitorKind.CSV, output_path=out, job_name="csv"),
    ]
    if wandb:
        policies.append(
            MonitorPolicy(MonitorKind.WANDB, output_path=out, job_name="wb", mode="offline")
        )
    return policies


@pytest.mark.usefixtures("wandb_env")
def test_rank0_fans_out_to_every_enabled_backend(tmp_path):
    pytest.importorskip("tensorboard")
    policies = _all_policies(tmp_path, wandb=True)
    policies.append(MonitorPolicy(MonitorKind.CSV, enabled=False, job_name="ignored"))
    series = _series(ranks=3)
    with Monitors(policies, rank=0) as monitors:
        assert monitors.configured
        assert monitors.active
        assert [type(m) for m in monitors.monitors] == [
            TensorBoardMonitor,
            CsvMonitor,
            WandbMonitor,
        ]
        wandb_monitor = monitors.monitors[2]
        assert isinstance(wandb_monitor, WandbMonitor)
        run_dir = wandb_monitor.run_dir
        assert run_dir is not None
        for step in series:
            monitors.write(step)
    assert not monitors.active
    monitors.close()  # already closed by the with block: a no-op
    with pytest.raises(RuntimeError, match=r"rank 0: Monitors\.write after close"):
        monitors.write(series[0])

    expected = _expected(series)
    runs = tmp_path / "runs"
    assert _read_tensorboard(runs / "tb") == expected
    assert _read_csv_dir(runs / "csv") == {csv_file_name(t): v for t, v in expected.items()}
    assert _read_wandb(run_dir)[1] == expected
    assert not Path("ignored").exists()


@pytest.mark.parametrize("rank", [1, 3])
def test_other_ranks_write_nothing(tmp_path, rank):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monitors = Monitors(_all_policies(tmp_path, wandb=True), rank=rank)
    assert monitors.configured  # same answer as rank 0: safe to decide on collectives
    assert not monitors.active
    assert monitors.monitors == ()
    for step in _series():
        monitors.write(step)
    with pytest.raises(TypeError, match="step must be an int"):
        monitors.write([(tags.TRAIN_LOSS, 1.0, 1.5)])  # type: ignore[list-item]
    monitors.close()
    monitors.close()
    assert list(tmp_path.iterdir()) == []


def test_fanout_rejects_bad_rank_and_duplicate_kinds(tmp_path):
    csv_policy = MonitorPolicy(MonitorKind.CSV, output_path=str(tmp_path))
    with pytest.raises(ValueError, match="rank"):
        Monitors([csv_policy], rank=-1)
    with pytest.raises(ValueError, match="'csv_monitor' is enabled by 2 policies"):
        Monitors([csv_policy, csv_policy], rank=0)
    nothing = Monitors([], rank=0)
    assert not nothing.configured
    assert not nothing.active
    nothing.write(_series()[0])
    nothing.close()

"""Hostfile parsing and the launcher's translation to torchrun arguments."""

from __future__ import annotations

import argparse
import os

import pytest

from zerotrain.cli.hostfile import (
    Host,
    HostfileError,
    parse_hostfile,
    select_hosts,
    this_node_rank,
)
from zerotrain.cli.run import add_run_arguments, plan_launch


def test_parse_hostfile_with_comments_and_default_slots():
    text = "# cluster\nworker-0 slots=4\n\nworker-1 slots=4  # second\nworker-2\n"
    assert parse_hostfile(text) == [Host("worker-0", 4), Host("worker-1", 4), Host("worker-2", 1)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-0 slots=x\n", "hostfile:1: expected 'hostname slots=N'"),
        ("a slots=2\na slots=2\n", "hostfile:2: host 'a' is listed twice"),
        ("a slots=0\n", "hostfile:1: slots must be >= 1"),
        ("# nothing\n", "no hosts listed"),
    ],
)
def test_bad_hostfiles_name_the_line(text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text)


def test_node_rank_is_found_by_name():
    hosts = [Host("a", 2), Host("b", 2)]
    assert this_node_rank(hosts, names={"b", "localhost"}) == 1
    with pytest.raises(HostfileError, match="pass --node-rank"):
        this_node_rank(hosts, names={"c"})


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args(list(argv))


def test_single_node_uses_standalone_rendezvous_and_splits_threads():
    plan = plan_launch(_args("-n", "2", "train.py", "--lr", "1"), environ={}, cuda_available=False)
    assert "--standalone" in plan.torchrun_args
    assert "--nproc-per-node=2" in plan.torchrun_args
    tail = ["zerotrain.cli.bootstrap", "--script", "train.py", "--lr", "1"]
    assert plan.torchrun_args[-5:] == tail
    cores = os.cpu_count() or 1
    assert plan.env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    one = plan_launch(_args("-n", "1", "t.py"), environ={}, cuda_available=False)
    assert one.env["OMP_NUM_THREADS"] == str(cores)
    preset = plan_launch(_args("t.py"), environ={"OMP_NUM_THREADS": "3"}, cuda_available=False)
    assert "OMP_NUM_THREADS" not in preset.env
    on_gpu = plan_launch(_args("-n", "2", "t.py"), environ={}, cuda_available=True)
    assert "OMP_NUM_THREADS" not in on_gpu.env


def test_hostfile_becomes_multi_node_rendezvous(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\n")
    args = _args("--hostfile", str(hostfile), "--node-rank", "1", "t.py")
    plan = plan_launch(args, environ={}, cuda_available=False)
    expected = (
        "--nproc-per-node=4",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500",
        "--node-rank=1",
    )
    for item in expected:
        assert item in plan.torchrun_args


@pytest.mark.parametrize(
    ("extra", "is_host"),
    [
        (("--node-rank", "0"), True),  # the hostfile's first host: the store's
        (("--node-rank", "1"), False),  # torchrun's own guess decides
        (("--node-rank", "0", "--master-addr", "10.0.0.5"), False),  # maybe node-a's IP
        (("--node-rank", "1", "--local-addr", "node-b", "--master-addr", "node-b"), True),
    ],
)
def test_the_rendezvous_host_is_named_outright(tmp_path, extra, is_host):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\n")
    args = _args("--hostfile", str(hostfile), *extra, "t.py")
    plan = plan_launch(args, environ={}, cuda_available=False)
    assert ("--rdzv-conf=is_host=1" in plan.torchrun_args) is is_host
    assert not any("is_host=0" in a for a in plan.torchrun_args)
    # Multi-host jobs get the peer watchdog, and restarts a fresh store per round.
    assert plan.env["ZEROTRAIN_PEER_TIMEOUT"] == "60"
    restarting = plan_launch(
        _args("--hostfile", str(hostfile), *extra, "--max-restarts", "2", "t.py"),
        environ={},
        cuda_available=False,
    )
    assert restarting.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_single_host_hostfile_stays_standalone(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n")
    plan = plan_launch(_args("--hostfile", str(hostfile), "t.py"), environ={}, cuda_available=False)
    assert "--standalone" in plan.torchrun_args
    assert "--nproc-per-node=3" in plan.torchrun_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("-n", "0", "t.py"), "-n must be >= 1, got 0"),
        (("--nnodes", "2", "t.py"), "--nnodes 2 needs the address of node 0"),
    ],
)
def test_inconsistent_launch_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        plan_launch(_args(*argv), environ={}, cuda_available=False)


def test_hostfile_with_uneven_slots_is_refused(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=4\nb slots=2\n")
    args = _args("--hostfile", str(hostfile), "--node-rank", "0", "t.py")
    with pytest.raises(HostfileError, match="slots differ"):
        plan_launch(args, environ={}, cuda_available=False)


HOSTS = [Host("w0", 4), Host("w1", 4), Host("w2", 4)]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, HOSTS),
        ({"include": "w1@w2:0,2"}, [Host("w1", 4), Host("w2", 2, (0, 2))]),
        ({"exclude": "w1"}, [Host("w0", 4), Host("w2", 4)]),
        (
            {"exclude": "w0:0,1@w2:3"},
            [Host("w0", 2, (2, 3)), Host("w1", 4), Host("w2", 3, (0, 1, 2))],
        ),
        ({"num_nodes": 2}, [Host("w0", 4), Host("w1", 4)]),
        ({"num_gpus": 2, "exclude": "w0"}, [Host("w1", 2), Host("w2", 2)]),
    ],
)
def test_deepspeed_launcher_filters_select_hosts_and_slots(kwargs, expected):
    assert select_hosts(HOSTS, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "w0", "exclude": "w1"}, "cannot be used together"),
        ({"include": "w9"}, "host 'w9' is not in the hostfile"),
        ({"include": "w0:7"}, r"'w0' has slots 0-3, not \[7\]"),
        ({"include": "w0:a"}, "must be integers"),
        ({"exclude": "w0@w1@w2"}, "no host is left"),
        ({"num_nodes": 0}, "--num_nodes must be >= 1"),
    ],
)
def test_bad_launcher_filters_say_what_is_wrong(kwargs, message):
    with pytest.raises(HostfileError, match=message):
        select_hosts(HOSTS, **kwargs)


def test_a_node_rank_outside_the_job_is_refused(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    with pytest.raises(HostfileError, match=r"--node-rank 2 is not a node of the job \(0\.\.1"):
        plan_launch(_args("--hostfile", str(hostfile), "--node-rank", "2", "t.py"), environ={})


def test_each_node_gets_the_devices_its_slots_name(tmp_path, monkeypatch):
    from zerotrain.cli.fanout import node_commands

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the launcher's own: not passed on
    hosts = select_hosts([Host("w0", 4), Host("w1", 4)], exclude="w0:0,1@w1:2,3")
    args = _args("--hostfile", "unused", "t.py")
    w0, w1 = node_commands(args, hosts, "w0", 29500)
    assert "CUDA_VISIBLE_DEVICES=2,3" in w0.remote[-1]
    assert "CUDA_VISIBLE_DEVICES=0,1 " in w1.remote[-1]
    assert "0,1,2,3" not in w0.remote[-1] + w1.remote[-1]
    assert "--nproc-per-node=2" in w0.argv
    assert "--nproc-per-node=2" in w1.argv


def test_a_negative_node_grace_is_refused_before_anything_starts(tmp_path, capsys):
    from zerotrain.cli.run import run

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    args = _args(
        "--hostfile", str(hostfile), "--node-grace", "-1", "--ssh-command", "false", "t.py"
    )
    assert run(args) == 2
    assert "--node-grace must be >= 0 seconds, got -1.0" in capsys.readouterr().err

"""A pipeline step that fails on one rank: the real error surfaces, every stage stops
together where it can, and nothing of the failed step reaches a later one (review
2026-11-28: P2, P3, P4, P5, P6; each test failed before its fix)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.pipe import LayerSpec, PipelineModule
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed

MICRO = 4
WIDTH = 4


class _Layer(nn.Module):
    """A linear layer that raises on its ``fail_on``-th forward (1-based; 0: never)."""

    def __init__(self, fail_on: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.fail_on = fail_on
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise ValueError(f"this layer refuses its forward number {self.calls}")
        return self.lin(x)


class _LossOnce:
    """An MSE loss that raises on its ``fail_on``-th call (1-based; 0: never)."""

    def __init__(self, fail_on: int = 0) -> None:
        self.fail_on = fail_on
        self.calls = 0

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyError("the loss refuses")
        return ((out - target) ** 2).mean()


def _engine(fail_layer_on: int = 0, fail_loss_on: int = 0, schedule: str = "gpipe"):
    torch.manual_seed(0)
    module = PipelineModule(
        [LayerSpec(_Layer, fail_layer_on), LayerSpec(_Layer)],
        num_stages=2,
        loss_fn=_LossOnce(fail_loss_on),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = zerotrain.initialize(model=module, config=config)
    return engine


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, WIDTH, generator=gen), torch.randn(1, WIDTH, generator=gen))] * MICRO


def _outcome(call) -> tuple[str, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _own_error_with_sends_unmatched() -> tuple[str, float]:
    # Stage 1's loss fails on micro-batch 0, so stage 0's sends of micro-batches 1 and 2
    # are never received; stage 0 then fails in its own forward of micro-batch 3.
    engine = _engine(fail_layer_on=4 if dist.get_rank() == 0 else 0, fail_loss_on=1)
    return _outcome(lambda: engine.train_batch(iter(_batches(1))))


def test_a_rank_that_fails_with_sends_unmatched_raises_its_own_error_at_once():
    """P4: the step waited in ``finally`` for sends whose receiver had failed, so after
    the collective timeout a CollectiveError replaced the real error."""
    first, second = run_distributed(
        _own_error_with_sends_unmatched, 2, comm_timeout=10, own_processes=BREAKS_THE_GROUP
    )
    assert first[0] == "ValueError: this layer refuses its forward number 4", first
    assert first[1] < 5, first
    assert second[0].startswith("KeyError"), second


def _eval_after_failure() -> tuple[str, str]:
    engine = _engine(fail_loss_on=1 if dist.get_rank() == 1 else 0)
    trained = _outcome(lambda: engine.train_batch(iter(_batches(1))))[0]
    evaluated = _outcome(lambda: engine.eval_batch(iter(_batches(2))))[0]
    return trained, evaluated


def test_eval_batch_is_refused_after_a_failed_step():
    """P2: eval_batch ran after a failed train_batch, over messages in an unknown state."""
    for trained, evaluated in run_distributed(
        _eval_after_failure, 2, comm_timeout=3, own_processes=BREAKS_THE_GROUP
    ):
        assert trained != "no error"
        assert evaluated.startswith("RuntimeError: an earlier train_batch/eval_batch failed")


def _failed_eval_then_train() -> str:
    engine = _engine(fail_loss_on=1 if dist.get_rank() == 1 else 0)
    _outcome(lambda: engine.eval_batch(iter(_batches(2))))
    return _outcome(lambda: engine.train_batch(iter(_batches(1))))[0]


def test_a_failed_eval_batch_refuses_the_next_train_batch():
    for after in run_distributed(
        _failed_eval_then_train, 2, comm_timeout=3, own_processes=BREAKS_THE_GROUP
    ):
        assert after.startswith("RuntimeError: an earlier train_batch/eval_batch failed"), after


def _new_engine_after_a_failed_one() -> list[float]:
    # The first engine's last stage fails on micro-batch 0 and its first stage on
    # micro-batch 3: stage 0's activations of micro-batches 1 and 2 stay unreceived. A
    # second engine on the same ranks must not read them.
    failed = _engine(fail_layer_on=4 if dist.get_rank() == 0 else 0, fail_loss_on=1)
    _outcome(lambda: failed.train_batch(iter(_batches(1))))
    fresh = _engine()
    return [float(fresh.train_batch(iter(_batches(2)))) for _ in range(2)]


def _clean_run() -> list[float]:
    engine = _engine()
    return [float(engine.train_batch(iter(_batches(2)))) for _ in range(2)]


def test_a_new_engine_never_meets_a_failed_engines_messages():
    """P6 (and P2's stale messages): with the pipeline spanning the job, its messages went
    over the job's own group, where the next engine's receives matched the failed engine's
    sends of the same tag, silently training on another step's activations."""
    after = run_distributed(
        _new_engine_after_a_failed_one, 2, comm_timeout=3, own_processes=BREAKS_THE_GROUP
    )
    clean = run_distributed(_clean_run, 2)
    assert after == clean


class _FailingLoader:
    def __iter__(self):
        return self

    def __next__(self):
        raise KeyError("the loader's storage went away")


def _loader_fails_on_the_first_stage() -> tuple[str, float]:
    engine = _engine()
    data = _FailingLoader() if dist.get_rank() == 0 else iter(_batches(1))
    return _outcome(lambda: engine.train_batch(data))


def test_a_data_loader_error_of_any_type_stops_every_stage_at_once():
    """P3: only StopIteration, ValueError and TypeError were agreed on; any other error on
    the first stage left the others waiting for the collective timeout."""
    first, last = run_distributed(_loader_fails_on_the_first_stage, 2, comm_timeout=20)
    assert first[0].startswith("KeyError"), first
    assert last[0].startswith("RuntimeError: pipeline stage(s) [0] could not read"), last
    assert last[1] < 10, last


class _Fanout(nn.Module):
    """Returns 33 tensors: one more than a boundary's message tags can number."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x * i for i in range(33))


class _Sum(nn.Module):
    def forward(self, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.stack(xs).sum(0)


def _too_many_tensors() -> tuple[str, float]:
    module = PipelineModule(
        [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(_Fanout), LayerSpec(_Sum)],
        num_stages=2,
        loss_fn=_LossOnce(),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerotrain.initialize(model=module, config=config)
    return _outcome(lambda: engine.train_batch(iter(_batches(1))))


def test_a_boundary_too_wide_for_its_tags_is_refused_on_both_sides():
    """P3: the sender refused before posting anything, and the receiver waited for the
    collective timeout for a description that never came."""
    for message, seconds in run_distributed(
        _too_many_tensors, 2, comm_timeout=20, own_processes=BREAKS_THE_GROUP
    ):
        assert "tensor index 32 is outside 0..31" in message, message
        assert seconds < 10, (message, seconds)


class _KeepPositive(nn.Module):
    """Keeps the rows whose first value is positive: its output's shape depends on its
    input's values, not only on its shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x[:, 0] > 0]


def _data_dependent_shape() -> tuple[str, float]:
    torch.manual_seed(0)
    module = PipelineModule(
        [LayerSpec(_KeepPositive), LayerSpec(nn.Linear, WIDTH, WIDTH)],
        num_stages=2,
        loss_fn=lambda out, target: out.pow(2).mean() + 0 * target.sum(),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerotrain.initialize(model=module, config=config)
    # Same shapes, different values: 2 rows kept, then 1.
    kept = torch.ones(2, WIDTH)
    batches = [(kept, torch.zeros(2, WIDTH)), (kept * torch.tensor([[1.0], [-1.0]]), kept)]
    outcome = _outcome(lambda: engine.train_batch(iter(batches)))
    time.sleep(3 if dist.get_rank() == 0 else 0)  # the refusing rank stays alive
    return outcome


def test_a_data_dependent_output_shape_stops_the_next_stage_at_once():
    """P3: the sending stage refused micro-batch 1's output (its shapes differ from
    micro-batch 0's, for inputs of the same shapes) and stayed alive; the receiving stage
    waited for the collective timeout. Through the same-host mailbox (gloo's default) the
    refusal reaches it at once."""
    first, last = run_distributed(
        _data_dependent_shape,
        2,
        comm_timeout=30,
        env={"ZEROTRAIN_P2P_MATCH": "tag"},
        own_processes=BREAKS_THE_GROUP,
    )
    assert first[0].startswith("RuntimeError: pipeline stage 0"), first
    assert "depend only" in first[0], first
    assert "rank 0 (global rank 0) abandoned its step: RuntimeError: pipeline stage 0" in last[0], (
        last
    )
    assert last[1] < 5, last  # not the 30 s timeout


def _forward_fails_mid_step() -> tuple[str, float]:
    engine = _engine(fail_layer_on=3 if dist.get_rank() == 0 else 0, schedule="1f1b")
    outcome = _outcome(lambda: engine.train_batch(iter(_batches(1))))
    time.sleep(3 if dist.get_rank() == 0 else 0)
    return outcome


def test_a_stage_that_fails_mid_step_stops_the_stages_waiting_on_it():
    first, last = run_distributed(
        _forward_fails_mid_step,
        2,
        comm_timeout=30,
        env={"ZEROTRAIN_P2P_MATCH": "tag"},
        own_processes=BREAKS_THE_GROUP,
    )
    assert first[0] == "ValueError: this layer refuses its forward number 3", first
    assert "abandoned its step: ValueError: this layer refuses its forward number 3" in last[0]
    assert last[1] < 5, last


def _one_stage_two_chunks() -> str:
    module = PipelineModule(
        [LayerSpec(_Layer) for _ in range(4)],
        num_stages=1,
        loss_fn=_LossOnce(),
        partition_method="uniform",
        virtual_stages=2,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "pipeline": {"stages": 1, "virtual_stages": 2, "schedule": "interleaved"},
    }
    return _outcome(lambda: zerotrain.initialize(model=module, config=config))[0]


def test_virtual_stages_on_one_stage_are_refused_at_initialize():
    """P5: accepted, then the first step raised an InvariantError about activations."""
    [message] = run_distributed(_one_stage_two_chunks, 1)
    assert message.startswith("ValueError: pipeline.virtual_stages=2 with one pipeline stage")


def test_the_failure_tests_model_trains_when_nothing_fails():
    """The model above trains (so the failures above are the injected ones)."""
    losses = run_distributed(_clean_run, 2)
    assert losses[0] == losses[1]
    assert losses[0][1] < losses[0][0]


def _in_place_first_layer(stages: int) -> list[float]:
    torch.manual_seed(0)
    layers = [
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.ReLU, inplace=True),  # the first layer of stage 1
        LayerSpec(nn.Linear, WIDTH, WIDTH),
    ]
    module = PipelineModule(
        layers,
        num_stages=stages,
        loss_fn=_LossOnce(),
        partition_method="uniform",
        seed_layers=True,  # the same weights however the layers are placed
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerotrain.initialize(model=module, config=config)
    return [float(engine.train_batch(iter(_batches(step)))) for step in range(3)]


def test_a_stage_whose_first_layer_works_in_place_trains_like_one_stage():
    """DeepSpeed's pipeline example (AlexNet, nn.ReLU(inplace=True)) failed at -p 2: "a leaf
    Variable that requires grad is being used in an in-place operation"."""
    pipelined = run_distributed(_in_place_first_layer, 2, 2)
    [whole] = run_distributed(_in_place_first_layer, 1, 1)
    for losses in pipelined:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole), rtol=0, atol=1e-6)


# Two ranks as a multi-host job runs them (plain processes with torchrun's variables, gloo
# over TCP, the peer watchdog on as by default), the first stage failing mid-step.
_FAILS_ACROSS_HOSTS = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import zerotrain
from tests.dist.test_pipeline_failures import _batches, _engine
zerotrain.init_distributed()
engine = _engine(fail_layer_on=3 if dist.get_rank() == 0 else 0, schedule="1f1b")
try:
    engine.train_batch(iter(_batches(1)))
    print("no error", flush=True)
except Exception as err:
    print(f"failed at {time.monotonic()}: {type(err).__name__}: {err}", flush=True)
if sys.argv[2] == "then-a-slow-collective":
    # After the failed step (the mailbox told rank 1 at once): a collective that waits 3 s
    # on rank 0, over gloo, outside any pipeline step: the notice must not end rank 1.
    import torch
    from zerotrain.comm.collectives import Communicator
    comm = Communicator(shared_memory=False)
    time.sleep(3 if dist.get_rank() == 0 else 0)
    comm.all_reduce(torch.ones(1), purpose="a checkpoint's agreement")
    print("after the collective", flush=True)
    sys.exit(0)
time.sleep(60)  # the failing rank stays alive: only the notice can tell the other
"""


def test_a_stage_that_fails_mid_step_stops_a_stage_on_another_host(tmp_path):
    """P3 across machines: the same-host mailbox cannot carry the failure notice there, and
    the waiting stage's receive over TCP cannot be interrupted. The failing rank publishes
    it in the job's store; the waiting rank's peer watchdog ends it a second or two later,
    quoting the error (exit code 75), instead of after the collective timeout (120 s)."""
    procs = _two_plain_ranks(tmp_path, "0", "and-stay")  # as between hosts: no mailbox
    try:
        code = procs[1].wait(timeout=60)
        ended = time.monotonic()
        output = procs[1].stdout.read()  # type: ignore[union-attr]
    finally:
        for proc in procs:
            proc.kill()
    first = procs[0].stdout.read()  # type: ignore[union-attr]
    failed = [line for line in first.splitlines() if line.startswith("failed at ")]
    assert failed, first
    assert "ValueError: this layer refuses its forward number 3" in failed[0], first
    assert code == 75, output
    assert "Rank(s) [0] abandoned their step: rank 0 (host " in output, output
    assert "abandoned its step: ValueError: this layer refuses its forward number 3" in output
    seconds = ended - float(failed[0].split()[2].rstrip(":"))
    print(f"the stage on the other host stopped {seconds:.1f} s after the failure")
    assert seconds < 5, output  # a second into its wait, not the 120 s timeout


def test_an_abandon_notice_ends_no_wait_outside_a_pipeline_step(tmp_path):
    """After the failed step, a slow collective (a checkpoint saved on the way out) is no
    reason to end a rank: the notice counts only inside a pipeline step."""
    procs = _two_plain_ranks(tmp_path, "1", "then-a-slow-collective")
    try:
        codes = [proc.wait(timeout=60) for proc in procs]
        outputs = [proc.stdout.read() for proc in procs]  # type: ignore[union-attr]
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [0, 0], (codes, outputs)
    assert all("after the collective" in out for out in outputs), outputs


def _two_plain_ranks(tmp_path: Path, shm: str, then: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(_FAILS_ACROSS_HOSTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")}
    env.update(
        ZEROTRAIN_SHM=shm,
        ZEROTRAIN_P2P_MATCH="tag",
        ZEROTRAIN_COMM_TIMEOUT="120",
        OMP_NUM_THREADS="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    repo = str(Path(__file__).resolve().parents[2])
    # Same host (shm "1"): one machine's local ranks; else each rank a host of its own.
    local = [("0", "1"), ("0", "1")] if shm == "0" else [("0", "2"), ("1", "2")]
    return [
        subprocess.Popen(
            [sys.executable, str(script), repo, then],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": local[rank][0],
                "LOCAL_WORLD_SIZE": local[rank][1],
            },
        )
        for rank in range(2)
    ]

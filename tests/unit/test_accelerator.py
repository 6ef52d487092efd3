"""zerotrain.accelerator answers DeepSpeed's accelerator calls as DeepSpeed documents them.

Each test calls a method the way DeepSpeed scripts do and checks DeepSpeed's documented
result (its CPU_Accelerator / CUDA_Accelerator); the CUDA cases run only where torch sees
a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

import zerotrain
from zerotrain.accelerator import (
    Accelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from zerotrain.accelerator import select as accel_select

MiB = 1 << 20
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    # Each test resolves the accelerator from its own environment.
    monkeypatch.setattr(accel_select._CURRENT, "accelerator", None)
    for name in ("DS_ACCELERATOR", "ZEROTRAIN_DEVICE", "LOCAL_RANK", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cpu(monkeypatch) -> Accelerator:
    monkeypatch.setenv("ZEROTRAIN_DEVICE", "cpu")
    return get_accelerator()


@pytest.fixture
def cuda() -> Accelerator:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return get_accelerator()


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


# Selection


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_machine_without_gpu_gets_the_cpu_accelerator_once():
    accel = get_accelerator()
    assert isinstance(accel, CpuAccelerator)
    assert accel.name == accel._name == "cpu"
    assert get_accelerator() is accel
    assert is_current_accelerator_supported()


def test_the_accelerator_follows_zerotrain_device(monkeypatch):
    _fake_gpu(monkeypatch)
    assert accel_select.accelerator_name() == "cuda"  # select_device picks CUDA when present
    monkeypatch.setenv("ZEROTRAIN_DEVICE", "cpu")
    assert accel_select.accelerator_name() == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CpuAccelerator)


def test_ds_accelerator_that_disagrees_with_the_engine_device_is_refused(monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(ValueError, match=r"computes on cuda.*set ZEROTRAIN_DEVICE=cpu as well"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setenv("ZEROTRAIN_DEVICE", "cpu")
    with pytest.raises(ValueError, match=r"ZEROTRAIN_DEVICE=cpu\); set ZEROTRAIN_DEVICE=cuda"):
        get_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_ds_accelerator_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match=r"DS_ACCELERATOR=cuda, but torch sees no CUDA device"):
        get_accelerator()


@pytest.mark.parametrize("value", ["xpu", "npu", "gpu"])
def test_an_unsupported_ds_accelerator_names_the_allowed_ones(monkeypatch, value):
    monkeypatch.setenv("DS_ACCELERATOR", value)
    with pytest.raises(ValueError, match=rf"one of 'cpu', 'cuda'.*got '{value}'"):
        get_accelerator()


def test_an_invalid_zerotrain_device_is_refused(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ZEROTRAIN_DEVICE must be 'cpu' or 'cuda'"):
        get_accelerator()


def test_set_accelerator_replaces_the_returned_object(cpu):
    mine = CpuAccelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    set_accelerator(CudaAccelerator())  # DeepSpeed lets a script choose; no GPU call yet
    assert get_accelerator().device_name() == "cuda"
    with pytest.raises(TypeError, match=r"needs a zerotrain\.accelerator\.Accelerator"):
        set_accelerator("cpu")  # type: ignore[arg-type]


def test_reachable_as_deepspeed_accelerator(cpu):
    deepspeed = zerotrain
    assert deepspeed.accelerator.get_accelerator() is cpu


# CPU: devices and backend


def test_cpu_device_names_and_backend(cpu):
    assert cpu.device_name() == "cpu"
    assert cpu.device_name(1) == "cpu"
    assert cpu.current_device_name() == "cpu"
    assert cpu.communication_backend_name() == "gloo"
    assert cpu.is_available()
    assert cpu.device() == torch.device("cpu")
    assert torch.zeros(2, device=cpu.device()).device.type == "cpu"
    cpu.set_device(0)
    cpu.synchronize()
    cpu.empty_cache()


def test_cpu_device_index_and_count_come_from_the_launcher(cpu, monkeypatch):
    assert cpu.current_device() == 0
    assert cpu.device_count() >= 1
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.current_device() == 3
    assert cpu.device_count() == 4


def test_cpu_is_a_synchronized_device(cpu):
    assert cpu.is_synchronized_device()
    assert cpu.use_host_timers()
    assert cpu.resolves_data_dependency()
    assert cpu.handles_memory_backpressure()


def test_cpu_dtypes(cpu):
    assert cpu.is_bf16_supported()
    assert isinstance(cpu.is_fp16_supported(), bool)
    dtypes = cpu.supported_dtypes()
    assert {torch.float32, torch.bfloat16} <= set(dtypes)
    assert (torch.float16 in dtypes) == cpu.is_fp16_supported()
    assert not cpu.is_triton_supported()


def test_cpu_tensors(cpu):
    t = torch.arange(6.0)
    pinned = cpu.pin_memory(t, align_bytes=64)
    assert torch.equal(pinned, t)
    assert not cpu.is_pinned(pinned)
    assert cpu.on_accelerator(t)
    assert cpu.FloatTensor([1.0, 2.0]).dtype == torch.float32
    assert cpu.LongTensor([1]).dtype == torch.int64
    assert cpu.BFloat16Tensor([1.0]).dtype == torch.bfloat16


# CPU: random numbers


def test_cpu_manual_seed_reproduces_torch_rand(cpu):
    cpu.manual_seed(1234)
    first = torch.rand(4)
    cpu.manual_seed_all(1234)
    assert torch.equal(torch.rand(4), first)
    assert cpu.initial_seed() == 1234
    assert cpu.random() is torch.random
    assert cpu.default_generator(0) is torch.default_generator


def test_cpu_rng_state_round_trips(cpu):
    state = cpu.get_rng_state()
    first = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


# CPU: memory (the process's resident set, as DeepSpeed's CPU accelerator)


def test_cpu_memory_is_the_resident_set_with_a_peak(cpu):
    allocated = cpu.memory_allocated()
    assert allocated > 0
    assert cpu.max_memory_allocated() >= allocated
    assert cpu.memory_reserved() > 0
    assert cpu.max_memory_reserved() >= cpu.memory_allocated() - MiB
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    assert cpu.total_memory() >= cpu.available_memory() > 0


def test_cpu_reset_peak_lowers_the_max_to_the_current_value(cpu):
    cpu.reset_peak_memory_stats()
    before = cpu.memory_allocated()
    big = torch.ones(64 * MiB // 4)  # touched, so resident
    assert cpu.memory_allocated() >= before + 48 * MiB
    peak = cpu.max_memory_allocated()
    del big  # 64 MiB is above glibc's mmap threshold: it goes back to the OS
    assert cpu.max_memory_allocated() == peak  # a peak stays until reset
    cpu.reset_peak_memory_stats()
    after = cpu.max_memory_allocated()
    assert after < peak - 32 * MiB
    assert after - cpu.memory_allocated() < 8 * MiB
    cpu.reset_max_memory_allocated()
    assert cpu.max_memory_allocated() < peak - 32 * MiB


# CPU: streams, events and hooks


def test_cpu_streams_and_events_are_no_ops(cpu):
    side = cpu.Stream()
    with cpu.stream(side):
        y = torch.ones(3) * 2
    side.wait_stream(cpu.current_stream())
    cpu.current_stream().wait_stream(side)
    cpu.default_stream().synchronize()
    assert torch.equal(y, torch.full((3,), 2.0))
    start, end = cpu.Event(enable_timing=True), cpu.Event(enable_timing=True)
    start.record()
    time.sleep(0.002)
    side.record_event(end)
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 1.0  # milliseconds
    with pytest.raises(RuntimeError, match="recorded"):
        cpu.Event(enable_timing=True).elapsed_time(end)


def test_cpu_hooks(cpu):
    calls = []
    cpu.lazy_call(lambda: calls.append(1))
    assert calls == [1]
    cpu.range_push("step")
    cpu.range_pop()
    assert cpu.amp() is torch.cpu.amp


def test_no_op_builders(cpu):
    assert cpu.create_op_builder("CPUAdamBuilder") is None
    with pytest.raises(NotImplementedError, match="zerotrain compiles no DeepSpeed ops"):
        cpu.get_op_builder("FusedAdamBuilder")


def test_launcher_environment(cpu):
    assert cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.export_envs() == []


# CUDA


def test_cuda_names_need_no_gpu():
    accel = CudaAccelerator()
    assert accel.device_name() == "cuda"
    assert accel.device_name(1) == "cuda:1"
    assert accel.device(1) == torch.device("cuda", 1)
    assert accel.communication_backend_name() == "nccl"
    assert not accel.is_synchronized_device()
    assert not accel.use_host_timers()
    assert accel.export_envs() == ["NCCL"]
    assert accel.create_op_builder("FusedAdamBuilder") is None


@needs_gpu
def test_cuda_is_chosen_on_a_gpu_machine(cuda):
    assert isinstance(cuda, CudaAccelerator)
    assert cuda.is_available()
    assert cuda.device_count() == torch.cuda.device_count()
    cuda.set_device(0)
    assert cuda.current_device() == 0
    assert cuda.current_device_name() == "cuda:0"
    assert is_current_accelerator_supported()


@needs_gpu
def test_cuda_dtypes(cuda):
    assert cuda.is_fp16_supported() == (torch.cuda.get_device_capability()[0] >= 7)
    dtypes = cuda.supported_dtypes()
    assert torch.float32 in dtypes
    assert (torch.bfloat16 in dtypes) == cuda.is_bf16_supported()


@needs_gpu
def test_cuda_tensors_and_pinning(cuda):
    t = torch.arange(6.0)
    pinned = cuda.pin_memory(t)
    assert cuda.is_pinned(pinned)
    assert torch.equal(pinned, t)
    on_gpu = cuda.FloatTensor([1.0, 2.0])
    assert on_gpu.device.type == "cuda"
    assert cuda.on_accelerator(on_gpu)
    assert not cuda.on_accelerator(t)


@needs_gpu
def test_cuda_manual_seed_reproduces_torch_rand(cuda):
    cuda.manual_seed(7)
    first = torch.rand(4, device="cuda")
    state = cuda.get_rng_state()
    second = torch.rand(4, device="cuda")
    cuda.manual_seed_all(7)
    assert torch.equal(torch.rand(4, device="cuda"), first)
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), second)
    assert cuda.initial_seed() == 7
    assert cuda.default_generator(0) is torch.cuda.default_generators[0]


@needs_gpu
def test_cuda_memory_figures(cuda):
    cuda.empty_cache()
    cuda.reset_peak_memory_stats()
    before = cuda.memory_allocated()
    big = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    assert cuda.memory_allocated() >= before + 16 * MiB
    assert cuda.memory_reserved() >= cuda.memory_allocated()
    del big
    peak = cuda.max_memory_allocated()
    assert peak >= before + 16 * MiB
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() < peak
    assert cuda.max_memory_reserved() >= cuda.memory_reserved()
    assert "allocated_bytes.all.current" in cuda.memory_stats()
    assert cuda.total_memory() >= cuda.available_memory() > 0


@needs_gpu
def test_cuda_streams_and_events(cuda):
    side = cuda.Stream()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        start.record()
        y = torch.ones(1024, device="cuda") * 2
        end.record()
    cuda.current_stream().wait_stream(side)
    cuda.synchronize()
    assert start.elapsed_time(end) >= 0
    assert torch.equal(y, torch.full((1024,), 2.0, device="cuda"))
    assert cuda.default_stream() == torch.cuda.default_stream()
    cuda.range_push("step")
    cuda.range_pop()
    calls = []
    cuda.lazy_call(lambda: calls.append(1))
    assert calls == [1]  # CUDA is initialised by now

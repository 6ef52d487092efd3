"""A device that cannot train in the configured dtype is refused with the key to change."""

from __future__ import annotations

import pytest
import torch

from zerotrain.precision.dtypes import UnsupportedDtypeError, check_device_supports


def test_this_cpu_trains_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_device_supports(dtype, torch.device("cpu"))


def test_a_torch_build_without_the_kernel_is_refused(monkeypatch):
    def missing(*args, **kwargs):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(torch.nn.functional, "linear", missing)
    with pytest.raises(UnsupportedDtypeError, match=r"fp16\.enabled=true.*cannot train in fp16"):
        check_device_supports(torch.float16, torch.device("cpu"))


def test_a_gpu_without_native_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(UnsupportedDtypeError, match=r"Tesla V100 \(compute capability 7\.0\)"):
        check_device_supports(torch.bfloat16, torch.device("cuda", 0))
    check_device_supports(torch.float16, torch.device("cuda", 0))  # fp16 is fine there

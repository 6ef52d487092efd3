"""Whether this device can train in a dtype."""

from __future__ import annotations

import torch

from zerotrain.config.policies import short_dtype_name


class UnsupportedDtypeError(RuntimeError):
    """The device this rank runs on cannot compute in the configured dtype."""


def check_device_supports(dtype: torch.dtype, device: torch.device) -> None:
    """Raise :class:`UnsupportedDtypeError` unless ``device`` can train in ``dtype``.

    CUDA answers from its capability (bf16 needs compute capability 8.0 or newer; emulated
    bf16 on older GPUs is refused rather than run many times slower). Elsewhere a linear
    layer's forward and backward run once in the dtype: whatever this build of torch
    cannot do fails here, with the config key to change, instead of in the first step.
    """
    if dtype == torch.float32:
        return
    name = short_dtype_name(dtype)
    key = f"{name}.enabled"
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability(device)
            raise UnsupportedDtypeError(
                f"{key}=true, but {torch.cuda.get_device_name(device)} (compute capability "
                f"{major}.{minor}) has no native bf16 support (needs 8.0 or newer); use "
                "fp16.enabled (with loss scaling) or fp32 on this GPU"
            )
        return
    try:
        weight = torch.ones(4, 4, dtype=dtype, device=device, requires_grad=True)
        x = torch.ones(2, 4, dtype=dtype, device=device)
        torch.nn.functional.linear(x, weight).sum().backward()
    except (RuntimeError, NotImplementedError) as err:
        raise UnsupportedDtypeError(
            f"{key}=true, but this torch build cannot train in {name} on {device} ({err}); "
            f"disable {key} or run on a device that supports it"
        ) from err

"""zerotrain: ZeRO data-parallel training for PyTorch with DeepSpeed-compatible configs.

The public surface::

    engine, optimizer, dataloader, lr_scheduler = zerotrain.initialize(model=..., config=...)
    loss = engine(batch); engine.backward(loss); engine.step()

Stage 3 extras: ``zerotrain.zero.Init`` and ``zerotrain.zero.GatheredParameters``.
Activation checkpointing: ``zerotrain.checkpointing.checkpoint`` / ``.apply``.
"""

from zerotrain import checkpointing, zero
from zerotrain.comm.env import init_distributed
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.engine.engine import Engine
from zerotrain.engine.initialize import initialize

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Engine",
    "__version__",
    "checkpointing",
    "init_distributed",
    "initialize",
    "load_config",
    "zero",
]

"""zerotrain: ZeRO data-parallel training for PyTorch with DeepSpeed-compatible configs.

The public surface::

    engine, optimizer, dataloader, lr_scheduler = zerotrain.initialize(model=..., config=...)
    loss = engine(batch); engine.backward(loss); engine.step()

Stage 3 extras: ``zerotrain.zero.Init`` and ``zerotrain.zero.GatheredParameters``.
DeepSpeed's script-level names: ``add_config_arguments``, ``init_distributed``,
``zerotrain.utils.RepeatingLoader``, ``zerotrain.runtime.utils.set_random_seed``,
``zerotrain.ops.adam.DeepSpeedCPUAdam`` / ``FusedAdam``, ``zerotrain.ops.lamb.FusedLamb``
(``import zerotrain as deepspeed``; docs/migrating_from_deepspeed.md).
Activation checkpointing: ``zerotrain.checkpointing.checkpoint`` / ``.apply``.
"""

from zerotrain import accelerator, checkpointing, elasticity, ops, runtime, utils, zero
from zerotrain.config.arguments import add_config_arguments
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.engine.distributed import init_distributed
from zerotrain.engine.engine import Engine
from zerotrain.engine.initialize import initialize

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Engine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "elasticity",
    "init_distributed",
    "initialize",
    "load_config",
    "ops",
    "runtime",
    "utils",
    "zero",
]

"""DeepSpeed's ``deepspeed.runtime`` import paths that scripts use, for
``import zerotrain as deepspeed``: ``runtime.utils.set_random_seed`` and
``runtime.dataloader.RepeatingLoader``. The implementations live in ``zerotrain.utils``."""

from zerotrain.runtime import dataloader, utils

__all__ = ["dataloader", "utils"]

"""DeepSpeed's ``deepspeed.runtime`` import paths that scripts use, for
``import zerotrain as deepspeed``: ``runtime.utils.set_random_seed``,
``runtime.dataloader.RepeatingLoader`` and ``runtime.zero.partition_parameters``
(``ZeroParamStatus``, ``GatheredParameters``, ``Init``). The implementations live in
``zerotrain.utils`` and ``zerotrain.zero``."""

from zerotrain.runtime import dataloader, utils, zero

__all__ = ["dataloader", "utils", "zero"]

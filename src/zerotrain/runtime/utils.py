"""``deepspeed.runtime.utils`` names scripts import."""

from zerotrain.utils.seed import set_random_seed

__all__ = ["set_random_seed"]

"""``deepspeed.runtime.dataloader`` names scripts import."""

from zerotrain.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]

"""The ZeRO strategy: what is partitioned (the stage) and when gradients are reduced."""

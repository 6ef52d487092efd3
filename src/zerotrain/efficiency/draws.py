"""Random draws every data-parallel rank makes identically, without communicating.

Dropping a layer or a token must be decided the same way on every rank: at ZeRO stage 3 a
rank that skipped a layer the others ran would miss their gather of its parameters, and a
gradient reduction over different sets of parameters would be wrong. Each draw comes from
a generator seeded by the feature's seed, a stream number and the micro-step, so it is the
same on every rank, repeats exactly on a rerun or after a resume, and leaves the global RNG
(dropout, data order) untouched.
"""

from __future__ import annotations

import torch

_MODULUS = (1 << 63) - 1


def shared_generator(seed: int, stream: int, micro_step: int) -> torch.Generator:
    """A CPU generator for draw ``stream`` of micro-step ``micro_step``."""
    mixed = (seed * 1_000_003 + stream) * 2_654_435_761 + micro_step
    return torch.Generator().manual_seed(mixed % _MODULUS)

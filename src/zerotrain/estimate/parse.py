"""Reading human-written counts and sizes: ``7e9``, ``1.3B``, ``350M``; ``24GiB``, ``80GB``."""

from __future__ import annotations

import re

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
# Bare K/M/G/T are binary (memory is sold and reported that way: "80G" is 80 GiB); a "B"
# after them decides: "GB" is decimal, "GiB" binary.
_BYTE_SUFFIX = {
    "": 1,
    "B": 1,
    "K": 2**10,
    "KIB": 2**10,
    "KB": 10**3,
    "M": 2**20,
    "MIB": 2**20,
    "MB": 10**6,
    "G": 2**30,
    "GIB": 2**30,
    "GB": 10**9,
    "T": 2**40,
    "TIB": 2**40,
    "TB": 10**12,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _split(text: str, what: str, examples: str) -> tuple[float, str]:
    match = _NUMBER.match(text.replace("_", "").replace(",", ""))
    if match is None:
        raise ValueError(f"{what} {text!r} is not a number; write e.g. {examples}")
    return float(match.group(1)), match.group(2).upper()


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``1.3B``, ``350M``, ``125k``, ``7,000,000``.

    Raises:
        ValueError: not a positive count, or an unknown suffix.
    """
    value, suffix = _split(text, "parameter count", "7e9, 1.3B, 350M")
    if suffix not in _COUNT_SUFFIX:
        raise ValueError(
            f"parameter count {text!r}: unknown suffix {suffix!r}; use K, M, B (or G) or T"
        )
    count = round(value * _COUNT_SUFFIX[suffix])
    if count < 1:
        raise ValueError(f"parameter count {text!r} must be at least 1")
    return count


def parse_bytes(text: str) -> int:
    """A memory size: ``24GiB``, ``80GB``, ``80G`` (binary), ``512MiB``, ``1073741824``.

    Raises:
        ValueError: not a non-negative size, or an unknown unit.
    """
    value, suffix = _split(text, "memory size", "24GiB, 80GB, 512MiB")
    if suffix not in _BYTE_SUFFIX:
        raise ValueError(
            f"memory size {text!r}: unknown unit {suffix!r}; use B, KiB, MiB, GiB, TiB "
            "(binary) or KB, MB, GB, TB (decimal)"
        )
    return round(value * _BYTE_SUFFIX[suffix])

"""Config errors that say what was wrong, where, and what is allowed.

Every problem found while loading a config becomes a :class:`ConfigProblem` with a dotted
path (``zero_optimization.offload_optimizer.device``); all of them are reported together in
one :class:`ConfigError`, so a user fixes a config in one pass instead of one key per run.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One thing wrong with a config: where it is and what to do about it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<top level>'}: {self.message}"


class ConfigError(ValueError):
    """A config that cannot be used as written. ``problems`` lists every issue found."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None):
        self.problems = tuple(problems)
        self.source = source
        where = f" ({source})" if source else ""
        count = len(self.problems)
        header = f"invalid zerotrain config{where}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([header, *(f"  - {p}" for p in self.problems)]))


def join_path(loc: Iterable[Any]) -> str:
    """``('zero_optimization', 'stage')`` -> ``'zero_optimization.stage'`` (list indices as [i])."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name``, if any is close enough to be a likely typo."""
    options = list(candidates)
    lowered = {c.lower(): c for c in options}
    if name.lower() in lowered:  # wrong case is the most common typo of all
        return lowered[name.lower()]
    matches = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_problem(path: str, key: str, valid: Iterable[str]) -> ConfigProblem:
    """Problem for a key the schema does not know, with a did-you-mean suggestion."""
    valid = sorted(valid)
    guess = closest(key, valid)
    if guess is not None:
        hint = f"did you mean '{guess}'?"
    else:
        hint = f"valid keys here: {', '.join(valid)}"
    return ConfigProblem(path, f"unknown key '{key}'; {hint}")


# What each pydantic error type means in the words of someone writing a JSON file.
_ALLOWED: Mapping[str, str] = MappingProxyType(
    {
        "int_type": "a whole number (integral floats such as 5e8 are accepted)",
        "int_from_float": "a whole number (integral floats such as 5e8 are accepted)",
        "int_parsing": "a whole number",
        "float_type": "a number",
        "float_parsing": "a number",
        "bool_type": "true or false",
        "string_type": "a string",
        "dict_type": "an object ({...})",
        "model_type": "an object ({...})",
        "model_attributes_type": "an object ({...})",
        "tuple_type": "a list",
        "list_type": "a list",
        "missing": "a value (this key is required)",
        "finite_number": "a finite number",
    }
)


def _allowed(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {
            "greater_than_equal": ">=",
            "greater_than": ">",
            "less_than_equal": "<=",
            "less_than": "<",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        return f"a number {op} {bound}"
    if kind in ("too_long", "too_short"):
        return f"a list of {ctx.get('max_length', ctx.get('min_length'))} items"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return _ALLOWED.get(kind, error["msg"])


def problems_from_validation(
    exc: ValidationError, prefix: tuple[Any, ...] = (), valid_keys_at: Any = None
) -> list[ConfigProblem]:
    """Translate a pydantic ``ValidationError`` into config problems with full paths.

    Args:
        exc: the error raised by ``model_validate``.
        prefix: path of the validated object inside the whole config.
        valid_keys_at: callable ``loc -> iterable of valid keys`` used for unknown-key hints.
    """
    problems: list[ConfigProblem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(prefix) + tuple(error["loc"])
        path = join_path(loc)
        if error["type"] == "extra_forbidden":
            valid = valid_keys_at(tuple(error["loc"][:-1])) if valid_keys_at else ()
            problems.append(unknown_key_problem(path, str(loc[-1]), valid))
        elif error["type"] == "missing":
            problems.append(ConfigProblem(path, "missing; " + _allowed(error)))
        elif error["type"] == "value_error":
            message = str((error.get("ctx") or {}).get("error", error["msg"]))
            # A check over a whole section (input is the section) already names the values.
            got = "" if isinstance(error["input"], dict) else f"got {error['input']!r}; "
            problems.append(ConfigProblem(path, got + message))
        else:
            problems.append(
                ConfigProblem(path, f"got {error['input']!r}; allowed: {_allowed(error)}")
            )
    return problems

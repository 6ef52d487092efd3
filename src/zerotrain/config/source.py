"""Where a config comes from: a dict, a JSON file, or ``--config PATH`` on the command line.

JSON errors are reported with line, column and the offending line. Two defects that are
common in published DeepSpeed configs get specific help: a trailing comma before ``}`` or
``]`` (accepted, with a warning, because its meaning is unambiguous) and unfilled template
placeholders such as ``CONFIG_CL_MIN`` (rejected: there is no value to guess).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerotrain.config.errors import ConfigError, ConfigProblem
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

CONFIG_FLAGS = ("--config", "--deepspeed_config", "--deepspeed-config")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def config_path_from_argv(argv: Sequence[str]) -> str | None:
    """The value of ``--config PATH`` (or ``--config=PATH``, or DeepSpeed's
    ``--deepspeed_config``) in ``argv``, or None."""
    for i, arg in enumerate(argv):
        for flag in CONFIG_FLAGS:
            if arg == flag:
                if i + 1 >= len(argv):
                    raise ConfigError([ConfigProblem(flag, "expects a path after it")])
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def _strip_trailing_commas(text: str) -> tuple[str, list[int]]:
    """Remove commas that directly precede ``}`` or ``]`` outside strings.

    Returns the new text and the 1-based line numbers of the removed commas.
    """
    out: list[str] = []
    removed_lines: list[int] = []
    in_string = escaped = False
    line = 1
    for i, ch in enumerate(text):
        if ch == "\n":
            line += 1
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == ",":
            rest = text[i + 1 :].lstrip()
            if rest[:1] in ("}", "]"):
                removed_lines.append(line)
                continue
        out.append(ch)
    return "".join(out), removed_lines


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError([ConfigProblem(key, "appears twice in the same object")])
        result[key] = value
    return result


# An unquoted word in a value position (``"key": WORD,``): a template placeholder.
_BARE_VALUE = re.compile(r":\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?=[,}\]\n])")


def _json_problem(text: str, err: json.JSONDecodeError) -> ConfigProblem:
    line_text = text.splitlines()[err.lineno - 1] if text.splitlines() else ""
    where = f"line {err.lineno}, column {err.colno}"
    word = _WORD.match(text, err.pos)
    if word and word.group() not in ("true", "false", "null"):
        message = (
            f"{where}: unquoted word '{word.group()}' is not JSON. It looks like a template "
            "placeholder that was never filled in; replace it with a value."
        )
        others = [
            f"'{m.group(1)}' (line {text.count(chr(10), 0, m.start(1)) + 1})"
            for m in _BARE_VALUE.finditer(text)
            if m.start(1) > err.pos and m.group(1) not in ("true", "false", "null")
        ]
        if others:
            message += f" Later placeholders: {', '.join(others)}."
    else:
        message = f"{where}: {err.msg}"
    return ConfigProblem("<json>", f"{message}\n      {line_text.strip()}")


def parse_json_text(text: str, source: str) -> dict[str, Any]:
    """Parse config JSON, tolerating trailing commas (with a warning) and nothing else."""
    cleaned, comma_lines = _strip_trailing_commas(text)
    try:
        data = json.loads(cleaned, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError:
        # Report positions against the text the user wrote, not the cleaned one.
        try:
            json.loads(text, object_pairs_hook=_reject_duplicates)
        except json.JSONDecodeError as original:
            err = original
        raise ConfigError([_json_problem(text, err)], source) from None
    except ConfigError as err:
        raise ConfigError(err.problems, source) from None
    if comma_lines:
        log.warning(
            "%s: ignored trailing comma(s) on line(s) %s; strict JSON parsers reject them",
            source,
            ", ".join(map(str, comma_lines)),
        )
    if not isinstance(data, dict):
        raise ConfigError(
            [
                ConfigProblem(
                    "<json>", f"the top level must be an object, got {type(data).__name__}"
                )
            ],
            source,
        )
    return data


def read_config_source(
    config: str | os.PathLike[str] | dict[str, Any] | None, argv: Sequence[str] | None = None
) -> tuple[dict[str, Any], str]:
    """Return ``(raw dict, description of its source)``.

    Args:
        config: a dict, a path to a JSON file, or None to look for ``--config`` in ``argv``.
        argv: command-line arguments to search when ``config`` is None (default ``sys.argv``).
    """
    if isinstance(config, dict):
        return dict(config), "dict"
    if config is None:
        import sys

        from_argv = config_path_from_argv(sys.argv[1:] if argv is None else argv)
        if from_argv is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "config",
                        "no config given: pass config=<dict or path> to zerotrain.initialize, "
                        "or --config PATH on the command line",
                    )
                ]
            )
        file = Path(from_argv)
        # --config is a common flag name; say where the path came from in every message.
        source = f"{file} (from --config on the command line)"
    else:
        file = Path(config)
        source = str(file)
    if not file.is_file():
        raise ConfigError([ConfigProblem("config", f"config file not found: {source}")])
    return parse_json_text(file.read_text(encoding="utf-8"), source), source

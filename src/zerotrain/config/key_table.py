"""The table of every config key and its status, and the section of docs/config.md made
from it.

``python -m zerotrain.config.key_table --write docs/config.md`` rewrites the text between
the ``<!-- key-table:start -->`` and ``<!-- key-table:end -->`` markers and nothing else;
``--check`` exits 1 when that text is stale. The rows are in ``key_rows.py``; the defaults
come from the schema, so they cannot drift from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from zerotrain.config.key_rows import ROWS, KeyRow, Status
from zerotrain.config.schema import ZeroTrainConfig
from zerotrain.config.types import LooseSection

START = "<!-- key-table:start -->"
END = "<!-- key-table:end -->"

__all__ = ["END", "ROWS", "START", "KeyRow", "Status", "render", "schema_fields", "splice"]


def _section_of(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The checked section model inside an annotation and the path infix that reaches its
    keys: ``""`` for a field, ``"[]"`` for list items, ``".<name>"`` for dict values. Loose
    sections count as leaves (their contents are not part of the schema)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None if issubclass(annotation, LooseSection) else (annotation, "")
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in args:
            found = _section_of(arg)
            if found is not None:
                return found
    if origin is list and args:
        item = _section_of(args[0])
        return (item[0], "[]") if item else None
    if origin is dict and len(args) == 2:
        value = _section_of(args[1])
        return (value[0], ".<name>") if value else None
    return None


def schema_fields(
    model: type[BaseModel] = ZeroTrainConfig, prefix: str = ""
) -> Iterator[tuple[str, FieldInfo]]:
    """Every key path of the schema with its field, sections before their keys."""
    for name, field in model.model_fields.items():
        path = prefix + name
        yield path, field
        nested = _section_of(field.annotation)
        if nested is not None:
            yield from schema_fields(nested[0], path + nested[1] + ".")


def _default(field: FieldInfo) -> str:
    """The default as a config would write it (blank for sections)."""
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
        return "" if isinstance(value, BaseModel) else json.dumps(value)
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    if isinstance(field.default, tuple):
        return json.dumps(list(field.default))
    return json.dumps(field.default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The markdown table, one row per key in ``ROWS`` order."""
    defaults = {path: _default(field) for path, field in schema_fields()}
    lines = ["| key | default | status | note |", "|---|---|---|---|"]
    for row in ROWS:
        default = defaults.get(row.path, "")
        if default not in ("", "unset", "required"):
            default = f"`{default}`"
        note = row.note
        if row.alias_of:
            note = f"→ `{row.alias_of}`" + (f"; {note}" if note else "")
        lines.append(f"| `{row.path}` | {_cell(default)} | {row.status.value} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


def splice(document: str, table: str) -> str:
    """``document`` with the text between the markers replaced by ``table``.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if document.count(START) != 1 or document.count(END) != 1:
        raise ValueError(f"expected one {START} and one {END} in the document")
    head, rest = document.split(START)
    _, tail = rest.split(END)
    if END in head:
        raise ValueError(f"{END} comes before {START}")
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Write or check the key table in a markdown file; 0 when it is (now) up to date."""
    parser = argparse.ArgumentParser(prog="python -m zerotrain.config.key_table")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, metavar="MD", help="rewrite the table in MD")
    action.add_argument("--check", type=Path, metavar="MD", help="fail if MD's table is stale")
    args = parser.parse_args(argv)
    path: Path = args.write or args.check
    current = path.read_text(encoding="utf-8")
    wanted = splice(current, render())
    if args.write:
        if wanted != current:
            path.write_text(wanted, encoding="utf-8")
        return 0
    if wanted != current:
        sys.stderr.write(f"{path}: key table is stale; run with --write {path}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

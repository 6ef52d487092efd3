"""The DeepSpeed hostfile format: one ``hostname slots=N`` per line, ``#`` comments."""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^(?P<host>[^\s#]+)(?:\s+slots\s*=\s*(?P<slots>\d+))?\s*$")


class HostfileError(ValueError):
    """A hostfile that cannot be used, with the file and line at fault."""


@dataclass(frozen=True, slots=True)
class Host:
    """One machine of the job and how many processes it runs."""

    name: str
    slots: int


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile text.

    Raises:
        HostfileError: a malformed line, a duplicate host, zero slots, or no hosts at all.
    """
    hosts: list[Host] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(
                f"{source}:{number}: expected 'hostname slots=N', got {raw.strip()!r}"
            )
        name, slots = match["host"], int(match["slots"] or 1)
        if slots < 1:
            raise HostfileError(f"{source}:{number}: slots must be >= 1, got {slots}")
        if name in seen:
            raise HostfileError(f"{source}:{number}: host {name!r} is listed twice")
        seen.add(name)
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Parse the hostfile at ``path`` (a missing file is a clear error)."""
    file = Path(path)
    if not file.is_file():
        raise HostfileError(f"hostfile not found: {path}")
    return parse_hostfile(file.read_text(), str(path))


def local_names() -> set[str]:
    """Names this machine may appear under in a hostfile."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    with contextlib.suppress(OSError):  # no resolvable name: the other names still apply
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return names


def this_node_rank(hosts: list[Host], names: set[str] | None = None) -> int:
    """Index of this machine in ``hosts``.

    Raises:
        HostfileError: this machine is not listed (pass ``--node-rank`` explicitly).
    """
    names = local_names() if names is None else names
    for index, host in enumerate(hosts):
        if host.name in names:
            return index
    raise HostfileError(
        f"this machine ({socket.gethostname()}) is not in the hostfile "
        f"({', '.join(h.name for h in hosts)}); pass --node-rank"
    )

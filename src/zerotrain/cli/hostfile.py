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
    """One machine of the job and how many processes it runs (``slot_ids``: which of its
    slots, i.e. local devices, when a filter chose some; None: the first ``slots``)."""

    name: str
    slots: int
    slot_ids: tuple[int, ...] | None = None


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


def _parse_filter(text: str, flag: str) -> dict[str, list[int] | None]:
    """DeepSpeed's ``--include``/``--exclude`` syntax: hosts joined by ``@``, each with an
    optional ``:slot,slot`` list (None: the whole host)."""
    chosen: dict[str, list[int] | None] = {}
    for part in text.split("@"):
        name, _, slots = part.strip().partition(":")
        if not name:
            raise HostfileError(f"{flag} {text!r}: an empty host name")
        try:
            chosen[name] = [int(s) for s in slots.split(",")] if slots else None
        except ValueError:
            raise HostfileError(
                f"{flag} {text!r}: slots of {name!r} must be integers, as in 'worker-1:0,2'"
            ) from None
    return chosen


def _keep(slots: list[int], wanted: list[int] | None) -> list[int]:
    return slots if wanted is None else [i for i in slots if i in wanted]


def _drop(slots: list[int], wanted: list[int] | None) -> list[int]:
    return [] if wanted is None else [i for i in slots if i not in wanted]


def select_hosts(
    hosts: list[Host],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> list[Host]:
    """The hosts (and processes per host) a job runs on, by DeepSpeed's launcher flags:
    ``include`` keeps only the named hosts (or slots of them), ``exclude`` drops them,
    then ``num_nodes`` keeps the first N hosts and ``num_gpus`` the first G slots of each.

    Raises:
        HostfileError: both filters, an unknown host or slot, or nothing left.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together")
    slots = {h.name: list(range(h.slots)) for h in hosts}
    for flag, text in (("--include", include), ("--exclude", exclude)):
        if not text:
            continue
        chosen = _parse_filter(text, flag)
        for name, wanted in chosen.items():
            if name not in slots:
                raise HostfileError(
                    f"{flag}: host {name!r} is not in the hostfile ({', '.join(slots)})"
                )
            bad = [s for s in wanted or [] if s not in slots[name]]
            if bad:
                raise HostfileError(
                    f"{flag}: {name!r} has slots 0-{len(slots[name]) - 1}, not {bad}"
                )
        if flag == "--include":
            slots = {n: _keep(s, chosen[n]) for n, s in slots.items() if n in chosen}
        else:
            slots = {n: _drop(s, chosen[n]) if n in chosen else s for n, s in slots.items()}
    full = {h.name: h.slots for h in hosts}
    selected = [
        Host(n, len(s), None if s == list(range(full[n])) else tuple(s))
        for n, s in slots.items()
        if s
    ]
    if num_nodes is not None:
        if num_nodes < 1:
            raise HostfileError(f"--num_nodes must be >= 1, got {num_nodes}")
        selected = selected[:num_nodes]
    if num_gpus is not None:
        if num_gpus < 1:
            raise HostfileError(f"--num_gpus must be >= 1, got {num_gpus}")
        selected = [
            Host(h.name, min(h.slots, num_gpus), h.slot_ids and h.slot_ids[:num_gpus])
            for h in selected
        ]
    if not selected:
        raise HostfileError("no host is left after --include/--exclude")
    return selected

"""Which network interface gloo binds when the job spans hosts.

gloo binds the address the machine's host name resolves to unless ``GLOO_SOCKET_IFNAME``
names an interface. On hosts with several networks (a management and a data network, a
container's bridge, a test's network namespace) that address may not reach the other hosts,
and every rank waits until its timeout. zerotrain picks, when the variable is unset, the
interface this host routes to the rendezvous address through: by construction one the other
hosts reach it by.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address
    return socket.inet_ntoa(packed[20:24])


def interface_towards(address: str) -> str | None:
    """The local interface whose address this host uses to reach ``address`` (None: no
    route, or not found)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # a UDP connect sends nothing; it only routes
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def choose_gloo_interface() -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface towards ``MASTER_ADDR`` when it is unset
    and the rendezvous is on another host; returns the name set (None: nothing done)."""
    master = os.environ.get("MASTER_ADDR")
    if not master or "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    try:
        resolved = socket.gethostbyname(master)
    except OSError:
        return None
    target = resolved
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(resolved).is_loopback:
            # Node 0's own name often resolves to 127.0.1.1 (Debian's /etc/hosts): on one
            # host gloo's default serves, across hosts the other hosts must reach this one,
            # so take the interface of the default route.
            world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
            if not (world.isdigit() and local.isdigit() and int(world) > int(local)):
                return None
            target = "192.0.2.1"  # any address off this host (TEST-NET-1; nothing is sent)
    name = interface_towards(target)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name

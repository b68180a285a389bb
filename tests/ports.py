"""Ports for the servers tests start.

Chosen below the kernel's ephemeral range: a port asked of the kernel (`bind(0)`) is one that any outgoing
connection on this machine, ours or another process's, may take between the choice and the server's bind.
Below that range only listeners take ports, and a clash with one still fails the start loudly.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000
_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports nothing holds now, none of them given out before in this process."""
    top = _ephemeral_start() - count
    for _ in range(1000):
        first = random.randrange(_LOWEST, top)
        ports = range(first, first + count)
        if _given.isdisjoint(ports) and all(_bindable(port) for port in ports):
            _given.update(ports)
            return first
    raise RuntimeError(f"no {count} consecutive free ports between {_LOWEST} and {top}")

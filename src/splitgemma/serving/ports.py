"""Free TCP ports, for processes started side by side: `splitgemma up`'s workers, the tests' stacks, the benchmarks."""

from __future__ import annotations

import socket


def address_family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on `host` now (all held open while choosing, so none is handed out twice). Another
    process may still take one before it is used: a server started on it then fails on a taken port, loudly."""
    socks = [socket.socket(address_family(host), socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

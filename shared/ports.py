"""A free TCP port for a server that is started, and binds, later: the embedded Redis (also
when it is restarted on its port after a crash), and every server a test starts.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, the same range
every outgoing connection's local port comes from. Between the pick and the server's own bind
workers start and connect (to Redis, to each other, UCX), and one of those sockets can land on
the picked port: the server then exits with "address already in use" (seen in CI,
``tests/services/test_tool_calls_cluster.py``). A port below the ephemeral range is never
handed out that way, so once checked free it stays free unless something binds it by number.
"""

from __future__ import annotations

import random
import socket

_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to, below the ephemeral range (falling back to
    one the kernel picks where that range starts too low to leave room)."""
    high = _ephemeral_low()
    low = max(10000, high - 20000)
    if high - low >= 1000:
        for _ in range(200):
            port = _rng.randrange(low, high)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
        return picked


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC targets and URLs write it: an IPv6 literal in brackets (gRPC read
    ``::1:0`` as host ``::0.1.0.0`` and refused to bind)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"

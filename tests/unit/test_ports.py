"""shared/ports.py: a server port (a test's, the embedded Redis's) is picked below the kernel's
ephemeral range, where no outgoing connection or ``bind(0)`` can take it before the server
binds it (CI saw a router fail with "address already in use" on a port that ``bind(0)`` had
handed out)."""

from __future__ import annotations

import socket

import pytest

from shared import ports


@pytest.mark.unit
def test_a_picked_port_is_free_and_outside_the_ephemeral_range():
    low = ports._ephemeral_low()
    if low - max(10000, low - 20000) < 1000:
        pytest.skip(f"ephemeral range starts at {low}: no room below it, the kernel picks")
    for _ in range(20):
        port = ports.free_port()
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


@pytest.mark.unit
def test_a_taken_port_is_not_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        real = ports._rng.randrange
        calls = []

        def pick(a: int, b: int) -> int:  # the taken port first, twice, then random ones
            calls.append(a)
            return taken if len(calls) <= 2 else real(a, b)

        monkeypatch.setattr(ports._rng, "randrange", pick)
        got = ports.free_port()
        assert got != taken and len(calls) >= 3

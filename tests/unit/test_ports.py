"""shared/ports.py: a server port (a test's, the embedded Redis's) is picked below the kernel's
ephemeral range, where no outgoing connection or ``bind(0)`` can take it before the server
binds it (CI saw a router fail with "address already in use" on a port that ``bind(0)`` had
handed out)."""

from __future__ import annotations

import socket

import pytest

from shared import ports
from shared.ports import host_port


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


@pytest.mark.unit
def test_host_port_brackets_ipv6_literals():
    assert host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert host_port("decode-0.pdserve", 5) == "decode-0.pdserve:5"
    assert host_port("::1", 5) == "[::1]:5"
    assert host_port("[::1]", 5) == "[::1]:5"
    assert host_port("fd00::a:1", 0) == "[fd00::a:1]:0"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.unit
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_worker_on_an_ipv6_host_binds_and_advertises_reachable_addresses():
    """``--host ::1``: the worker's gRPC bind of ``::1:0`` failed (gRPC read it as host
    ``::0.1.0.0``), and its metrics server's AF_INET socket could not bind an IPv6 address."""
    import asyncio
    import urllib.request
    from argparse import Namespace

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prometheus_client import CollectorRegistry

    from shared.security import ClusterSecurity
    from shared.worker.service import advertise, start_metrics_server

    args = Namespace(host="::1", advertise_host=None, port=0)

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = ClusterSecurity().add_port(server, host_port(args.host, args.port))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(advertise(args, port)) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    asyncio.run(main())
    httpd = start_metrics_server("::1", 0, CollectorRegistry())
    try:
        url = f"http://{advertise(args, httpd.server_port)}/health"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.read() == b"ok\n"
    finally:
        httpd.shutdown()

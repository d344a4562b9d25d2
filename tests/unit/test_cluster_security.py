"""ClusterSecurity on real gRPC servers in this process: the cluster token (refused without
it, health open) and gRPC over TLS and mutual TLS with a CA made for the test."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.security import ClusterSecurity, SecurityConfigError

pytestmark = pytest.mark.unit
SECRET = b"s" * 32


class _Stats(pb_grpc.DecodeWorkerServicer):
    async def Stats(self, request, context):
        return pb.WorkerStats(worker_id="w")


async def _serve(security: ClusterSecurity) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=security.server_interceptors())
    pb_grpc.add_DecodeWorkerServicer_to_server(_Stats(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call(client: ClusterSecurity, address: str, metadata=None) -> str:
    async with client.aio_channel(address, []) as ch:
        reply = await pb_grpc.DecodeWorkerStub(ch).Stats(
            pb.StatsRequest(),
            timeout=5,
            metadata=client.call_metadata if metadata is None else metadata,
        )
        return reply.worker_id


def _code(coro) -> grpc.StatusCode:
    try:
        asyncio.run(coro)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_calls_need_the_cluster_token_and_health_stays_open():
    async def scenario():
        server, address = await _serve(ClusterSecurity(secret=SECRET))
        try:
            member = ClusterSecurity(secret=SECRET)
            assert await _call(member, address) == "w"
            codes = []
            for stranger in (ClusterSecurity(), ClusterSecurity(secret=b"x" * 32)):
                try:
                    await _call(stranger, address)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            async with grpc.aio.insecure_channel(address) as ch:
                h = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            return codes, h.status
        finally:
            await server.stop(None)

    codes, status = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    files = {"ca": root / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, ident in (("server", "127.0.0.1"), ("client", "client.pdserve.test")):
        cert = ca.issue_cert(ident)
        files[name] = root / f"{name}.pem"
        files[name + "-key"] = root / f"{name}-key.pem"
        cert.cert_chain_pems[0].write_to_path(str(files[name]))
        cert.private_key_pem.write_to_path(str(files[name + "-key"]))
    return {k: str(v) for k, v in files.items()}


def test_grpc_over_tls_verifies_the_server(pki):
    server_sec = ClusterSecurity(
        secret=SECRET, ssl_certfile=pki["server"], ssl_keyfile=pki["server-key"]
    )
    trusting = ClusterSecurity(secret=SECRET, ssl_ca_certs=pki["ca"])

    async def scenario(client):
        server, address = await _serve(server_sec)
        try:
            return await _call(client, address)
        finally:
            await server.stop(None)

    assert asyncio.run(scenario(trusting)) == "w"
    # a client speaking plaintext to the TLS port gets no answer
    assert _code(scenario(ClusterSecurity(secret=SECRET))) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    both = {"ssl_ca_certs": pki["ca"], "secret": SECRET}
    server_sec = ClusterSecurity(ssl_certfile=pki["server"], ssl_keyfile=pki["server-key"], **both)
    member = ClusterSecurity(ssl_certfile=pki["client"], ssl_keyfile=pki["client-key"], **both)
    no_cert = ClusterSecurity(**both)

    async def scenario(client):
        server, address = await _serve(server_sec)
        try:
            return await _call(client, address)
        finally:
            await server.stop(None)

    assert asyncio.run(scenario(member)) == "w"
    assert _code(scenario(no_cert)) == grpc.StatusCode.UNAVAILABLE


def test_bad_security_settings_are_start_up_errors(tmp_path):
    with pytest.raises(SecurityConfigError, match="at least 16 bytes"):
        ClusterSecurity(secret=b"short")
    with pytest.raises(SecurityConfigError, match="together"):
        ClusterSecurity(ssl_certfile=str(tmp_path / "c.pem"))
    with pytest.raises(SecurityConfigError, match="cannot read --grpc-ssl-ca-certs"):
        ClusterSecurity(ssl_ca_certs=str(tmp_path / "missing.pem"))
    empty = tmp_path / "secret"
    empty.write_text("\n")
    with pytest.raises(SecurityConfigError, match="is empty"):
        ClusterSecurity.from_environ({"PDSERVE_CLUSTER_SECRET_FILE": str(empty)})
    assert repr(ClusterSecurity(secret=SECRET)).count("s" * 32) == 0  # never shown

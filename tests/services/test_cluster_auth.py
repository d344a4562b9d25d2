"""Only cluster members call workers: a call without the cluster token, or with a wrong one,
is refused with UNAUTHENTICATED and changes nothing; the health service stays open (probes)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.security import TOKEN_HEADER, ClusterSecurity
from tests.cluster_utils import channel_to, decode_stub, make_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("auth"), prefill=1, decode=1)
    c.start_redis()
    workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    yield c
    c.stop()


def _generate(stub, metadata):
    req = pb.GenerateRequest(
        request_id="auth-probe",
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    )
    return [c for c in stub.Generate(req, timeout=60, metadata=metadata)]


WRONG = ((TOKEN_HEADER, "0" * 64),)


def _calls(stub, decode: bool, metadata):
    """Every RPC of the worker's service, with ``metadata``."""
    calls = [lambda: stub.Stats(pb.StatsRequest(), timeout=10, metadata=metadata)]
    if decode:
        calls.append(lambda: _generate(stub, metadata))
        calls.append(
            lambda: stub.Abort(pb.AbortRequest(request_id="x"), timeout=10, metadata=metadata)
        )
    else:
        calls.append(
            lambda: stub.Prefill(
                pb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2]),
                timeout=10,
                metadata=metadata,
            )
        )
    return calls


@pytest.mark.parametrize("metadata", [(), WRONG], ids=["no-token", "wrong-token"])
def test_a_call_without_the_cluster_token_is_refused(cluster, metadata):
    for name in ("decode-0", "prefill-0"):
        address = cluster.ready[name]["grpc"]
        with grpc.insecure_channel(address) as ch:  # no token added by the channel
            stub = (pb_grpc.DecodeWorkerStub if "decode" in name else pb_grpc.PrefillWorkerStub)(ch)
            calls = _calls(stub, "decode" in name, metadata)
            for call in calls:
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
                assert "cluster secret" in e.value.details()
            # the health service answers anyone (Kubernetes' gRPC probe sends no metadata)
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_a_member_is_served_and_the_refused_calls_changed_nothing(cluster):
    with channel_to(cluster.ready["decode-0"]["grpc"]) as ch:
        stub = decode_stub(ch)
        chunks = _generate(stub, ())
        assert sum(len(d.token_ids) for c in chunks for d in c.outputs) == 3
        stats = stub.Stats(pb.StatsRequest(check_integrity=True), timeout=10)
        assert stats.integrity_ok and stats.running == 0 and stats.used_blocks == 0


def test_the_cluster_secret_is_not_on_any_command_line(cluster):
    secret = ClusterSecurity.from_env().secret
    assert secret
    for child in cluster.children:
        with open(f"/proc/{child.proc.pid}/cmdline", "rb") as f:
            assert secret not in f.read()

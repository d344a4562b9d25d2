"""Container healthcheck: exit 0 when the local pdserve process reports ready, else 1.

    healthcheck.py grpc PORT   a worker: grpc.health.v1 Check("") answers SERVING
    healthcheck.py http PORT   the router: GET /health answers 200 (a decode worker is routable)

Runs inside the container against 127.0.0.1 (workers and router bind 0.0.0.0 there); imports only
what the router image needs (grpcio, grpcio-health-checking), never torch.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def grpc_ok(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            print(f"grpc health: {e.code().name}", file=sys.stderr)
            return False
    print(f"grpc health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT_S) as r:
            print(r.read().decode(errors="replace"))
            return r.status == 200
    except urllib.error.HTTPError as e:  # 503 carries the reason in its body
        print(e.read().decode(errors="replace"), file=sys.stderr)
    except OSError as e:
        print(f"http health: {e}", file=sys.stderr)
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grpc", "http") or not argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    check = grpc_ok if argv[0] == "grpc" else http_ok
    return 0 if check(int(argv[1])) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

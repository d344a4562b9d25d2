"""gRPC channel and server options every pdserve process uses (no imports: the router too).

Clients ping every 3 s and give up on a peer that does not answer within 3 s, so a frozen or
partitioned peer (SIGSTOP, a dead host) fails its calls with UNAVAILABLE within about 6 s
instead of at the end of the freeze or at the request deadline; the router then resumes the
streams elsewhere, a decode worker prefills locally. Reconnects back off 0.1 s to 1 s at most,
so a restarted peer is reachable as soon as it listens again. Servers accept those pings
(at most one a second counts as abuse otherwise: gRPC's default is one per five minutes).
"""

MAX_MESSAGE_BYTES = 64 << 20
KEEPALIVE_MS = 3_000

CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]

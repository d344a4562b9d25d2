"""Worker plumbing shared by the two roles: the engine thread (``engine_loop.py``), the runtime
with its Redis lease, KV-event publisher, metrics endpoint, health and drain (``service.py``,
``metrics.py``), and the gRPC boundary checks and conversions (``wire.py``)."""

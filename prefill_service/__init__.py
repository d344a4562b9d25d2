"""Prefill worker: the PrefillWorker gRPC service over a paged-KV engine (prefill role)."""

"""Decode worker: the DecodeWorker gRPC service over a paged-KV engine (decode role)."""

"""Latency of the collectives a TP/PP worker makes per step, between two gloo processes on this
machine: a 1 KiB all-reduce, a send/recv round trip and a small ``broadcast_object_list`` (the
control message). Explains the TP / PP step times in docs/benchmarks.md.

    python bench/gloo_latency.py [--calls 500]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank(r: int, port: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    x = torch.ones(1, 256)
    box = [("step", [([1, 2, 3], 0, [4, 5, 6])], [0])]

    def ping() -> None:
        if r == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    out = {}
    for name, fn in (
        ("all_reduce 1 KiB", lambda: dist.all_reduce(x)),
        ("send/recv round trip 1 KiB", ping),
        ("broadcast_object_list (a small step)", lambda: dist.broadcast_object_list(box, src=0)),
    ):
        for _ in range(calls // 10):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    if r == 0:
        for name, us in out.items():
            print(f"{name:40s} {us:8.0f} us")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank(a.rank, a.port, a.calls)
        return 0
    port = _port()
    other = subprocess.Popen(
        [sys.executable, __file__, "--rank", "1", "--port", str(port), "--calls", str(a.calls)]
    )
    rank(0, port, a.calls)
    return other.wait()


if __name__ == "__main__":
    sys.exit(main())

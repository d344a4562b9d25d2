"""Does NIXL (the data plane vLLM's and Dynamo's disaggregation use) run on this machine, and how
fast does it move host memory, next to a loopback TCP socket moving the same bytes in the same
run? A probe for issue 14, item 5, not a kvtransfer backend (none is built on NIXL yet).

NIXL is optional and not in pdserve's dependencies: ``nixl-cu12`` declares torch as a
dependency (a CUDA build), so install it without its dependencies into a scratch venv:

    python -m venv /tmp/nixl && /tmp/nixl/bin/pip install --no-deps nixl-cu12 numpy
    /tmp/nixl/bin/python bench/nixl_probe.py [--mib 8,64] [--rounds 5]

Two NIXL agents with the UCX backend in one process, DRAM registered on both, one WRITE of the
whole buffer per round, timed until the initiator sees DONE; then the same bytes through a
TCP_NODELAY socket pair (sendall in a thread, recv_into the destination) with a 1-byte ack.
Every round checks the destination against the source.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import numpy as np


def nixl_rounds(n: int, rounds: int) -> list[float]:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("probe-a", cfg), nixl_agent("probe-b", cfg)
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    a.register_memory([(src.ctypes.data, n, 0, "")], mem_type="DRAM")
    b.register_memory([(dst.ctypes.data, n, 0, "")], mem_type="DRAM")
    peer = a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.get_xfer_descs([(src.ctypes.data, n, 0)], mem_type="DRAM")
    remote = b.get_xfer_descs([(dst.ctypes.data, n, 0)], mem_type="DRAM")
    out = []
    for _ in range(rounds):
        dst[:] = 0
        h = a.initialize_xfer("WRITE", local, remote, peer, b"probe")
        t0 = time.perf_counter()
        a.transfer(h)
        deadline = t0 + 30
        while (state := a.check_xfer_state(h)) not in ("DONE", "ERR"):
            if time.perf_counter() > deadline:
                raise TimeoutError("NIXL transfer did not complete in 30 s")
        dt = time.perf_counter() - t0
        a.release_xfer_handle(h)
        if state != "DONE" or not np.array_equal(src, dst):
            raise RuntimeError(
                f"NIXL transfer ended {state}, bytes equal: {np.array_equal(src, dst)}"
            )
        out.append(n / dt / 1e9)
    return out


def socket_rounds(n: int, rounds: int) -> list[float]:
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    srv = socket.create_server(("127.0.0.1", 0))
    tx = socket.create_connection(srv.getsockname())
    rx, _ = srv.accept()
    for s in (tx, rx):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    view = memoryview(dst)
    for _ in range(rounds):
        dst[:] = 0
        t0 = time.perf_counter()
        th = threading.Thread(target=lambda: (tx.sendall(memoryview(src)), tx.recv(1)))
        th.start()
        got = 0
        while got < n:
            got += rx.recv_into(view[got:], n - got)
        rx.sendall(b"k")
        th.join(30)
        dt = time.perf_counter() - t0
        if not np.array_equal(src, dst):
            raise RuntimeError("socket bytes differ")
        out.append(n / dt / 1e9)
    for s in (tx, rx, srv):
        s.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="8,64")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print("| MiB | NIXL (UCX, DRAM) GB/s | socket GB/s | NIXL / socket |")
    print("|---:|---:|---:|---:|")
    for mib in (int(x) for x in args.mib.split(",")):
        n = mib << 20
        nx = statistics.median(nixl_rounds(n, args.rounds))
        so = statistics.median(socket_rounds(n, args.rounds))
        print(f"| {mib} | {nx:.2f} | {so:.2f} | {nx / so:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One ``Generate`` call per request against the shared ``GenerateMux`` call
(``shared/proto/mux.py``), between two processes, without an engine: what each costs per
streamed chunk in latency and in CPU on each side.

A server process plays a decode worker whose engine steps every ``--step-ms``: at each step
every running stream gets one chunk (stamped with ``time.monotonic()``, a system-wide clock).
The client (this process) runs ``--streams`` streams at once of ``--chunks`` chunks each, in
both modes, interleaved for ``--rounds`` rounds, and prints for each mode the delivery latency
(stamp to the client's read, p50 / p90 / p99) and the CPU time of the server and the client per
chunk (``/proc``, both whole processes).

    python bench/mux_latency.py [--streams 1,16,64] [--chunks 200] [--step-ms 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.mux import GenerateMuxMixin, MuxClient


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


# ---- server ---------------------------------------------------------------------------------


class _Stepper(GenerateMuxMixin, pb_grpc.DecodeWorkerServicer):
    """Every ``step_s`` one "engine step": each running stream's queue gets a chunk."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.queues: set[asyncio.Queue] = set()
        self.task: asyncio.Task | None = None

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            now = time.monotonic()
            for q in list(self.queues):
                q.put_nowait(now)

    async def Generate(self, request, context):
        if self.task is None:
            self.task = asyncio.ensure_future(self._steps())
        q: asyncio.Queue = asyncio.Queue()
        self.queues.add(q)
        try:
            for i in range(int(request.request_id.split("-")[-1])):
                stamp = await q.get()
                chunk = pb.GenerateChunk(
                    request_id=request.request_id,
                    outputs=[pb.SeqDelta(index=0, token_ids=[i])],
                )
                chunk.timings.decode_s = stamp
                yield chunk
        finally:
            self.queues.discard(q)


async def _serve(port: int, step_s: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_DecodeWorkerServicer_to_server(_Stepper(step_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


# ---- client ---------------------------------------------------------------------------------


async def _one(call) -> list[float]:
    lat = []
    while True:
        chunk = await call.read()
        if chunk is grpc.aio.EOF:
            return lat
        lat.append(time.monotonic() - chunk.timings.decode_s)


async def _round(stub, mux: MuxClient, mode: str, streams: int, chunks: int, tag: str):
    reqs = [pb.GenerateRequest(request_id=f"{tag}-{j}-{chunks}") for j in range(streams)]
    calls = [mux.start(r) if mode == "mux" else stub.Generate(r) for r in reqs]
    lats = await asyncio.gather(*(_one(c) for c in calls))
    return [x for lat in lats for x in lat]


async def _client(args, server_pid: int) -> None:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{args.port}")
    stub = pb_grpc.DecodeWorkerStub(ch)
    mux = MuxClient(lambda: stub.GenerateMux(), "bench")
    await _round(stub, mux, "mux", 4, 20, "warm")
    await _round(stub, mux, "per-request", 4, 20, "warmp")
    print(
        f"server steps every {args.step_ms} ms; {args.chunks} chunks per stream; "
        f"{args.rounds} rounds, modes interleaved"
    )
    print(
        "| streams | mode | latency p50 / p90 / p99 (us) | server CPU per chunk (us) "
        "| client CPU per chunk (us) |"
    )
    print("|---:|---|---:|---:|---:|")
    for streams in (int(s) for s in args.streams.split(",")):
        res: dict[str, dict[str, list[float]]] = {}
        for r in range(args.rounds):
            modes = ("mux", "per-request") if r % 2 == 0 else ("per-request", "mux")
            for mode in modes:
                print(f"[mux_latency] streams {streams} round {r + 1} {mode}", file=sys.stderr)
                s0, c0 = _cpu_s(server_pid), _cpu_s(os.getpid())
                lat = await _round(stub, mux, mode, streams, args.chunks, f"{mode}{r}{streams}")
                s1, c1 = _cpu_s(server_pid), _cpu_s(os.getpid())
                d = res.setdefault(mode, {"lat": [], "srv": [], "cli": []})
                d["lat"] += lat
                d["srv"].append((s1 - s0) / len(lat))
                d["cli"].append((c1 - c0) / len(lat))
        for mode, d in res.items():
            lat = sorted(d["lat"])
            q = [lat[int(p * (len(lat) - 1))] * 1e6 for p in (0.5, 0.9, 0.99)]
            print(
                f"| {streams} | {mode} | {q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} "
                f"| {statistics.median(d['srv']) * 1e6:.0f} "
                f"| {statistics.median(d['cli']) * 1e6:.0f} |"
            )
    await mux.close()
    await ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=50997)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve(args.port, args.step_ms / 1e3))
        return 0
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "--port",
            str(args.port),
            "--step-ms",
            str(args.step_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "READY":
            print("the server did not start", file=sys.stderr)
            return 1
        asyncio.run(_client(args, server.pid))
    finally:
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""KV transfer benchmark: kvtransfer (UCX or NIXL) versus a plain TCP socket, same bytes, same run.

Two processes on this host: this one sends, a spawned one receives. For each transfer size
(1, 16, 256 blocks of the small model's 32 KiB block by default) it alternates rounds of

* **kvtransfer** over ``--transport`` (``ucx``, the default, or ``nixl``): ``sender.open`` ->
  ``send_blocks`` (one coalesced run) -> ``finish``, timed until the sender's handle is DONE,
  i.e. the receiver has verified every block (xxh3 checksums on, unless ``--no-checksums``)
  and acknowledged;
* **socket**: ``sendall`` of the same pool bytes over one TCP connection (TCP_NODELAY),
  ``recv_into`` the receiver's pool, timed until a 1-byte acknowledgement comes back;

and **raw UCX**: the same exchange as the socket mode over plain ucxx tag messages (same UCX
settings, no kvtransfer protocol, no I/O thread), which separates UCX's own cost from the
layer's (``ucx`` only: NIXL brings its own UCX, and two UCX copies in one process are not
safe). Each round runs the modes back to back; ``--window`` transfers are in flight (1 =
one at a time, latency-bound). It prints median GB/s and the median per-round ratio. Usage::

    python -m bench.kv_transfer_bench                       # defaults: 1,16,256 blocks, window 1
    python -m bench.kv_transfer_bench --window 8 --rounds 5
    python -m bench.kv_transfer_bench --transport nixl --rounds 7
    python -m bench.kv_transfer_bench --model ~/.cache/pdserve/compare/medium-llama  # its block
    python -m bench.kv_transfer_bench --ucx-option TCP_TX_SEG_SIZE=64k --progress-spin-us 50

This is a measurement script, not a test: it asserts only that every transfer completed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

BLOCK_GEOMETRY = {
    "model": "tiny-llama",
    "dtype": "bfloat16",
    "block_size": 16,
    "num_layers": 4,
    "num_kv_heads": 4,
    "head_dim": 32,
}


@dataclass(frozen=True)
class Measurement:
    mode: str
    blocks: int
    transfers: int
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def us_per_transfer(self) -> float:
        return self.seconds / self.transfers * 1e6


def geometry_of(model_dir: str | None) -> dict:
    """The KV block geometry of a Hugging Face model directory (bf16, 16-token blocks, as the
    services run it); the small model's when ``model_dir`` is None."""
    if model_dir is None:
        return dict(BLOCK_GEOMETRY)
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "block_size": 16,
        "num_layers": cfg["num_hidden_layers"],
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def _slot_ids(slot: int, k: int) -> list[int]:
    return list(range(slot * k, slot * k + k))


class _RawUcx:
    """Plain ucxx tagged messages driven synchronously on the calling thread: what UCX alone
    achieves with the same settings, without kvtransfer's protocol and I/O thread."""

    def __init__(self, ucx_options: dict, spin_us: float = 0.0):
        import select

        import ucxx._lib.libucxx as ucx_api

        from kvtransfer.ucx import _ucx_config

        self.api = ucx_api
        self.context = ucx_api.UCXContext(_ucx_config(ucx_options))
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.epoll = select.epoll()
        self.epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self.spin_s = spin_us * 1e-6
        self.accepted: list = []
        self.listener = None
        self.ep = None

    def listen(self) -> int:
        self.listener = self.api.UCXListener.create(
            self.worker, 0, self.accepted.append, deliver_endpoint=True
        )
        return self.listener.port

    def accept(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.accepted:
            self.worker.progress()
            if time.monotonic() > deadline:
                raise TimeoutError("no raw UCX connection")
            time.sleep(0.001)
        self.ep = self.accepted[0]

    def connect(self, port: int) -> None:
        self.ep = self.api.UCXEndpoint.create(self.worker, "127.0.0.1", port, True)

    def wait(self, requests: list) -> None:
        spin_until = time.perf_counter() + self.spin_s
        while not all(r.completed for r in requests):
            self.worker.progress()
            if time.perf_counter() < spin_until:
                continue
            if not all(r.completed for r in requests) and self.worker.arm():
                self.epoll.poll(0.1)
        for r in requests:
            r.check_error()

    def send(self, buf, tag: int):
        from ucxx._lib.arr import Array

        return self.ep.tag_send(Array(buf), self.api.UCXXTag(tag))

    def recv(self, buf, tag: int):
        from ucxx._lib.arr import Array

        return self.ep.tag_recv(Array(buf), self.api.UCXXTag(tag))

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close_blocking(10_000_000, 1)
        self.ep = self.listener = None


# ---- receiving process ------------------------------------------------------------------


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("socket closed by the sender")
        got += n


def _receiver_main(pipe, num_blocks: int, opts: dict) -> None:
    from kvtransfer import KVGeometry, create_receiver

    geometry = KVGeometry(**opts["geometry"])
    bb = geometry.block_bytes
    pool = np.zeros(num_blocks * bb, dtype=np.uint8)
    receiver = create_receiver(
        opts["transport"],
        pool,
        geometry,
        verify_checksums=opts["checksums"],
        ucx_options=opts["ucx_options"],
        progress_spin_us=opts["spin_us"],
    )
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    raw = _RawUcx(opts["ucx_options"], opts["spin_us"]) if opts["transport"] == "ucx" else None
    pipe.send((receiver.address, server.getsockname()[1], raw.listen() if raw else None))
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = np.ones(1, dtype=np.uint8)
    handles = []
    try:
        while True:
            cmd = pipe.recv()
            if cmd[0] == "expect":
                _, k, n, window, prefix = cmd
                handles = [
                    receiver.expect(f"{prefix}-{i}", _slot_ids(i % window, k), 60) for i in range(n)
                ]
                pipe.send("ok")
            elif cmd[0] == "check":
                states = [h.wait(60).value for h in handles]
                bad = [(h.transfer_id, str(h.error)) for h in handles if h.error is not None]
                pipe.send((states.count("done"), bad[:3]))
            elif cmd[0] == "socket":
                _, k, n, window = cmd
                mv = memoryview(pool)
                for i in range(n):
                    slot = i % window
                    _recv_exact(conn, mv[slot * k * bb : (slot + 1) * k * bb])
                    conn.sendall(b"\x01")
                pipe.send("ok")
            elif cmd[0] == "raw":
                _, k, n, window = cmd
                assert raw is not None
                if raw.ep is None:
                    raw.accept()
                for i in range(n):
                    slot = i % window
                    raw.wait([raw.recv(pool[slot * k * bb : (slot + 1) * k * bb], 1)])
                    raw.wait([raw.send(ack, 2)])
                pipe.send("ok")
            elif cmd[0] == "quit":
                break
    finally:
        if raw is not None:
            raw.close()
        conn.close()
        server.close()
        receiver.close()


# ---- sending side -----------------------------------------------------------------------


def _run_ucx(sender, pipe, address: bytes, k: int, n: int, window: int, prefix: str) -> Measurement:
    pipe.send(("expect", k, n, window, prefix))
    assert pipe.recv() == "ok"
    inflight = []
    t0 = time.perf_counter()
    for i in range(n):
        if len(inflight) >= window:
            inflight.pop(0).wait(60)
        slot = i % window
        h = sender.open(f"{prefix}-{i}", address, _slot_ids(slot, k), 60)
        h.send_blocks(_slot_ids(slot, k), 0)
        h.finish()
        inflight.append(h)
    for h in inflight:
        h.wait(60)
    seconds = time.perf_counter() - t0
    pipe.send(("check",))
    done, bad = pipe.recv()
    if done != n:
        raise RuntimeError(f"only {done}/{n} UCX transfers completed: {bad}")
    return Measurement("kvtransfer", k, n, seconds, n * k * sender.geometry.block_bytes)


def _run_socket(
    sock: socket.socket, pipe, pool: np.ndarray, bb: int, k: int, n: int, window: int
) -> Measurement:
    pipe.send(("socket", k, n, window))
    mv = memoryview(pool)
    ack = bytearray(1)
    pending = 0
    t0 = time.perf_counter()
    for i in range(n):
        if pending >= window:
            sock.recv_into(ack)
            pending -= 1
        slot = i % window
        sock.sendall(mv[slot * k * bb : (slot + 1) * k * bb])
        pending += 1
    while pending:
        if sock.recv_into(ack) == 1:
            pending -= 1
    seconds = time.perf_counter() - t0
    assert pipe.recv() == "ok"
    return Measurement("socket", k, n, seconds, n * k * bb)


def _run_raw(
    raw: _RawUcx, pipe, pool: np.ndarray, bb: int, k: int, n: int, window: int
) -> Measurement:
    """Same exchange as the socket mode (data message, 1-byte ack), over plain ucxx."""
    pipe.send(("raw", k, n, window))
    acks = [np.zeros(1, dtype=np.uint8) for _ in range(window)]
    pending: list = []
    t0 = time.perf_counter()
    for i in range(n):
        if len(pending) >= window:
            raw.wait(pending.pop(0))
        slot = i % window
        pending.append(
            [raw.send(pool[slot * k * bb : (slot + 1) * k * bb], 1), raw.recv(acks[slot], 2)]
        )
    for reqs in pending:
        raw.wait(reqs)
    seconds = time.perf_counter() - t0
    assert pipe.recv() == "ok"
    return Measurement("ucx-raw", k, n, seconds, n * k * bb)


def run(args: argparse.Namespace) -> list[dict]:
    from kvtransfer import KVGeometry, create_sender

    geometry = KVGeometry(**geometry_of(args.model))
    bb = geometry.block_bytes
    sizes = [int(s) for s in args.blocks.split(",")]
    num_blocks = max(sizes) * args.window
    ucx_options = dict(kv.split("=", 1) for kv in args.ucx_option)
    opts = {
        "checksums": not args.no_checksums,
        "ucx_options": ucx_options,
        "spin_us": args.progress_spin_us,
        "transport": args.transport,
        "geometry": geometry_of(args.model),
    }
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(there, num_blocks, opts), daemon=True)
    proc.start()
    pool = np.random.default_rng(0).integers(0, 256, size=num_blocks * bb, dtype=np.uint8)
    extra = {"max_message_bytes": args.max_message_bytes} if args.max_message_bytes else {}
    sender = create_sender(
        args.transport,
        pool,
        geometry,
        checksums=opts["checksums"],
        ucx_options=ucx_options,
        progress_spin_us=args.progress_spin_us,
        max_active_transfers=max(64, args.window),
        **extra,
    )
    results = []
    try:
        if not here.poll(60):
            raise RuntimeError("receiver process did not start")
        address, port, raw_port = here.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw = _RawUcx(ucx_options, args.progress_spin_us) if raw_port is not None else None
        if raw is not None:
            raw.connect(raw_port)
        sender.connect(address)
        tag = 0
        for k in sizes:
            n = max(args.min_transfers, min(args.max_transfers, args.bytes_per_round // (k * bb)))
            _run_ucx(sender, here, address, k, min(n, 8), args.window, f"warm{k}")  # warm-up
            _run_socket(sock, here, pool, bb, k, min(n, 8), args.window)
            if raw is not None:
                _run_raw(raw, here, pool, bb, k, min(n, 8), args.window)
            ucx, plain, sockets = [], [], []
            for _ in range(args.rounds):
                tag += 1
                ucx.append(_run_ucx(sender, here, address, k, n, args.window, f"r{tag}"))
                if raw is not None:
                    plain.append(_run_raw(raw, here, pool, bb, k, n, args.window))
                sockets.append(_run_socket(sock, here, pool, bb, k, n, args.window))
            row = {
                "blocks": k,
                "bytes_per_transfer": k * bb,
                "transfers_per_round": n,
                "rounds": args.rounds,
                "window": args.window,
                "checksums": opts["checksums"],
                "ucx_gbps": statistics.median(m.gbps for m in ucx),
                "transport": args.transport,
                "ucx_raw_gbps": statistics.median(m.gbps for m in plain) if plain else None,
                "socket_gbps": statistics.median(m.gbps for m in sockets),
                "ucx_us": statistics.median(m.us_per_transfer for m in ucx),
                "ucx_raw_us": statistics.median(m.us_per_transfer for m in plain)
                if plain
                else None,
                "socket_us": statistics.median(m.us_per_transfer for m in sockets),
                "ucx_gbps_rounds": [round(m.gbps, 3) for m in ucx],
                "ucx_raw_gbps_rounds": [round(m.gbps, 3) for m in plain],
                "socket_gbps_rounds": [round(m.gbps, 3) for m in sockets],
            }
            # Each round runs the three modes back to back, so a per-round ratio compares them
            # under the same background load; report the median of those ratios.
            row["ratio"] = statistics.median(u.gbps / s.gbps for u, s in zip(ucx, sockets))
            row["raw_ratio"] = (
                statistics.median(p.gbps / s.gbps for p, s in zip(plain, sockets))
                if plain
                else None
            )
            results.append(row)
        here.send(("quit",))
        sock.close()
        if raw is not None:
            raw.close()
    finally:
        sender.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return results


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(
        f"kvtransfer over {args.transport} vs raw TCP socket, 2 processes on one host, "
        f"block {results[0]['bytes_per_transfer'] // results[0]['blocks'] // 1024} KiB, "
        f"window={args.window}, "
        f"checksums={'off' if args.no_checksums else 'on'}, rounds={args.rounds} "
        f"(medians; ratios are medians of per-round ratios)"
    )
    print(
        "  kvtransfer = sender.open..finish until DONE (protocol, checksums, I/O thread); "
        "raw = plain ucxx tag send + 1-byte ack; socket = sendall + 1-byte ack"
    )
    print(
        f"{'blocks':>6} {'bytes':>9} | {'kvtransfer':>10} {'raw UCX':>8} {'socket':>8} GB/s | "
        f"{'kvt/sock':>8} {'raw/sock':>8} | {'kvt us':>7} {'raw us':>7} {'sock us':>7}"
    )

    def opt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in results:
        print(
            f"{r['blocks']:>6} {r['bytes_per_transfer']:>9} | {r['ucx_gbps']:>10.3f} "
            f"{opt(r['ucx_raw_gbps'], '>8.3f'):>8} {r['socket_gbps']:>8.3f}      | "
            f"{r['ratio']:>8.2f} {opt(r['raw_ratio'], '>8.2f'):>8} | "
            f"{r['ucx_us']:>7.0f} {opt(r['ucx_raw_us'], '>7.0f'):>7} {r['socket_us']:>7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="1,16,256", help="comma-separated transfer sizes in blocks")
    ap.add_argument("--window", type=int, default=1, help="transfers in flight at once")
    ap.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory whose KV block to move (default: the small "
        "model's 32 KiB block)",
    )
    ap.add_argument("--transport", choices=("ucx", "nixl"), default="ucx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bytes-per-round", type=int, default=64 << 20)
    ap.add_argument("--min-transfers", type=int, default=20)
    ap.add_argument("--max-transfers", type=int, default=1000)
    ap.add_argument("--no-checksums", action="store_true")
    ap.add_argument(
        "--ucx-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="UCX setting without the UCX_ prefix (repeatable)",
    )
    ap.add_argument("--progress-spin-us", type=float, default=0.0)
    ap.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="sender's coalescing cap (default: the sender's own default)",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    results = run(args)
    print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

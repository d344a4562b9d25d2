"""A KV transfer peer in its own process, driven by JSON lines on stdin (tests only).

Usage: ``python peer.py ROLE GEOMETRY_JSON NUM_BLOCKS [--port P] [--no-checksums]
[--seed S] [--kind ucx|nixl] [--settle-timeout S] [--corrupt ID:INDEX]``, ROLE = ``receiver`` or ``sender``. The pool is a numpy uint8 array (no torch
import, so the process starts fast); a sender's pool is filled from ``--seed``.

Prints ``{"event": "ready", "address": <hex>}`` once listening (receiver) or started (sender),
then answers each command with one JSON line:

* ``{"cmd": "expect", "id", "blocks", "timeout"}`` -> ``{"event": "expected"}``
* ``{"cmd": "wait", "id", "timeout"}`` -> ``{"event": "result", "state", "error_type", "error",
  "digests"}`` (blake2b of each destination block, receiver only)
* ``{"cmd": "send", "id", "address", "src", "dst", "timeout", "chunk", "finish", "wait"}``
  (sender) -> ``{"event": "result", ...}`` or ``{"event": "sending"}`` when ``wait`` is false
* ``{"cmd": "raw", "address", "payloads": [hex...], "settle": s}`` -> ``{"event": "replies",
  "ops": [...]}``: open a bare UCX connection, send the payloads as control messages verbatim
  and report every op that comes back
* ``{"cmd": "pool_digest"}`` -> ``{"event": "pool", "digest"}`` (whole pool, blake2b)
* ``{"cmd": "progress", "id"}`` -> ``{"event": "progress", "state", "blocks_done"}`` (blocks
  received, or sent)
* ``{"cmd": "send_more", "id", "src", "first", "timeout"}`` (sender): the rest of a transfer
  started with ``"finish": false``, then finish and wait -> ``{"event": "result", ...}``
* ``{"cmd": "connect", "address"}`` (sender) -> ``{"event": "connected"}``
* NIXL senders only, on their one connection: ``{"cmd": "tamper", "mode": "address" |
  "size"}`` makes the next READY frame point outside the pool or announce one byte more;
  ``{"cmd": "garbage"}`` sends an undecodable READY frame -> ``{"event": "ok", "alive"}``
* ``{"cmd": "nixl_reads"}`` (NIXL receivers) -> ``{"event": "reads", "outstanding"}``: NIXL
  reads posted and not yet ended
* ``{"cmd": "stats"}`` -> counters; ``{"cmd": "quit"}`` exits cleanly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from kvtransfer import CorruptBlocks, KVGeometry, create_receiver, create_sender
from kvtransfer.protocol import ReceiverAddress, decode_ops


def block_digests(pool: np.ndarray, block_bytes: int, ids: list[int]) -> list[str]:
    return [
        hashlib.blake2b(
            pool[b * block_bytes : (b + 1) * block_bytes].tobytes(), digest_size=16
        ).hexdigest()
        for b in ids
    ]


def fill_pool(pool: np.ndarray, seed: int) -> None:
    pool[:] = np.random.default_rng(seed).integers(0, 256, size=pool.shape, dtype=np.uint8)


def result_of(handle, pool=None, block_bytes=0) -> dict:
    out = {
        "event": "result",
        "id": handle.transfer_id,
        "state": handle.state.value,
        "error_type": type(handle.error).__name__ if handle.error else None,
        "error": str(handle.error) if handle.error else None,
        "seconds": handle.seconds,
    }
    if pool is not None:
        out["digests"] = block_digests(pool, block_bytes, list(handle.block_ids))
        out["checksums"] = handle.checksums
    return out


def raw_exchange(
    address: bytes,
    payloads: list,
    settle: float,
    unframed: bool = False,
    geometry: KVGeometry | None = None,
) -> tuple[list, list]:
    """Send control payloads verbatim over a bare UCX link; collect decoded replies and whether
    the receiver closed the connection. ``unframed`` writes the bytes to the stream without the
    frame header (a corrupt frame). A payload is hex bytes, or a step:
    ``{"hello": SECRET_HEX}`` waits for the receiver's challenge and answers it with a hello
    proven with that secret; ``{"tags": [...], "nbytes": n}`` sends an n-byte tagged data
    message (0xEE bytes) with each tag, straight to the receiver's worker."""
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXXTag

    from kvtransfer.auth import hello_proof, new_nonce
    from kvtransfer.protocol import Challenge, Hello, encode_ops
    from kvtransfer.ucx import UcxTransport

    transport = UcxTransport(name="raw")
    replies: list = []
    closed: list = []
    try:

        def setup():
            link = transport.connect(ReceiverAddress.decode(address))
            link.on_ctrl = lambda p: replies.append(p)
            link.on_closed = lambda e: closed.append(str(e))
            link.start()
            return link

        def send(p: bytes) -> None:
            if unframed:
                data = np.frombuffer(p, dtype=np.uint8)
                transport.worker.track(link._ep.stream_send(Array(data)), lambda *_: None, data)
            else:
                link.send_ctrl(p)

        def send_tagged(tags: list[int], nbytes: int) -> None:
            for tag in tags:
                data = np.full(nbytes, 0xEE, dtype=np.uint8)
                req = link._ep.tag_send(Array(data), UCXXTag(tag))
                transport.worker.track(req, lambda *_: None, data)

        link = transport.reactor.run_sync(setup)
        for p in payloads:
            if isinstance(p, dict) and "hello" in p:
                deadline = time.monotonic() + 10
                challenge = None
                while challenge is None and time.monotonic() < deadline:
                    for raw in list(replies):
                        for op in decode_ops(raw):
                            if isinstance(op, Challenge):
                                challenge = op
                    time.sleep(0.01)
                assert challenge is not None, "no challenge from the receiver"
                secret = bytes.fromhex(p["hello"]) or None
                nonce = new_nonce()
                mac = hello_proof(secret, challenge.nonce, nonce, "rogue")
                assert geometry is not None
                hello = Hello(geometry.to_wire(), True, "rogue", nonce, mac)
                transport.reactor.run_sync(send, encode_ops([hello]))  # the stream keeps order
            elif isinstance(p, dict) and "tags" in p:
                transport.reactor.run_sync(send_tagged, p["tags"], p["nbytes"])
            else:
                transport.reactor.run_sync(send, bytes.fromhex(p))
        time.sleep(settle)
        transport.reactor.run_sync(link.close)
    finally:
        transport.close()
    ops = []
    for p in replies:
        try:
            ops += [
                {
                    **{k: v.hex() if isinstance(v, bytes) else v for k, v in vars(op).items()},
                    "op": type(op).__name__,
                }
                for op in decode_ops(p)
            ]
        except Exception as e:  # noqa: BLE001  (report, do not crash the peer)
            ops.append({"op": "undecodable", "error": str(e)})
    return ops, closed


def lie_on_link(sender, cmd: dict) -> bool:
    """Make a NIXL sender's one connection misbehave (see the module docstring); returns
    whether the link is alive afterwards (for ``garbage``: after the receiver had time to
    answer)."""
    (link,) = sender._transport.links
    if cmd["cmd"] == "garbage":
        sender._reactor.run_sync(link._inner.send_ctrl, bytes([2]) + b"\xc1garbage")
        deadline = time.monotonic() + 10
        while link.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(link.alive)
    original = link._send_frame
    used = []

    def send_frame(kind: int, body: list) -> None:
        if kind == 2 and not used:
            used.append(True)
            tag, addr, nbytes, dev, md = body
            body = (
                [tag, 16, nbytes, dev, md]
                if cmd["mode"] == "address"
                else [tag, addr, nbytes + 1, dev, md]
            )
        original(kind, body)

    def install() -> None:
        link._send_frame = send_frame

    sender._reactor.run_sync(install)
    return bool(link.alive)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("receiver", "sender"))
    ap.add_argument("geometry")
    ap.add_argument("num_blocks", type=int)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--no-checksums", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--secret", default="", help="cluster secret, hex (empty: none)")
    ap.add_argument("--hello-timeout", type=float, default=5.0)
    ap.add_argument("--kind", default="ucx", choices=("ucx", "nixl"), help="transport")
    ap.add_argument("--settle-timeout", type=float, default=5.0, help="settle bound (either role)")
    ap.add_argument(
        "--corrupt", action="append", default=[], help="TRANSFER_ID:BLOCK_INDEX to corrupt (sender)"
    )
    args = ap.parse_args()
    geometry = KVGeometry(**json.loads(args.geometry))
    bb = geometry.block_bytes
    pool = np.zeros(args.num_blocks * bb, dtype=np.uint8)
    secret = bytes.fromhex(args.secret) or None

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    handles = {}
    if args.role == "receiver":
        endpoint = create_receiver(
            args.kind,
            pool,
            geometry,
            port=args.port,
            verify_checksums=not args.no_checksums,
            secret=secret,
            hello_timeout_s=args.hello_timeout,
            settle_timeout_s=args.settle_timeout,
        )
        emit({"event": "ready", "address": endpoint.address.hex()})
    else:
        fill_pool(pool, args.seed)
        corrupt = {(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1])) for c in args.corrupt}
        endpoint = create_sender(
            args.kind,
            pool,
            geometry,
            checksums=not args.no_checksums,
            secret=secret,
            settle_timeout_s=args.settle_timeout,
            fault_injector=CorruptBlocks(corrupt) if corrupt else None,
        )
        emit({"event": "ready", "address": None})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            kind = cmd["cmd"]
            if kind == "quit":
                break
            if kind == "expect":
                handles[cmd["id"]] = endpoint.expect(cmd["id"], cmd["blocks"], cmd["timeout"])
                emit({"event": "expected", "id": cmd["id"]})
            elif kind == "wait":
                h = handles[cmd["id"]]
                h.wait(cmd["timeout"])
                emit(result_of(h, pool if args.role == "receiver" else None, bb))
            elif kind == "send":
                h = endpoint.open(
                    cmd["id"], bytes.fromhex(cmd["address"]), cmd["dst"], cmd["timeout"]
                )
                handles[cmd["id"]] = h
                src, chunk = cmd["src"], cmd.get("chunk") or len(cmd["src"])
                for i in range(0, len(src), chunk):
                    h.send_blocks(src[i : i + chunk], i)
                if cmd.get("finish", True):
                    h.finish()
                if cmd.get("wait", True):
                    h.wait(cmd["timeout"] + 5)
                    emit(result_of(h))
                else:
                    emit({"event": "sending", "id": cmd["id"]})
            elif kind == "raw":
                ops, closed = raw_exchange(
                    bytes.fromhex(cmd["address"]),
                    cmd["payloads"],
                    cmd.get("settle", 0.5),
                    cmd.get("unframed", False),
                    geometry,
                )
                emit({"event": "replies", "ops": ops, "closed": closed})
            elif kind == "progress":
                h = handles[cmd["id"]]
                done = h.blocks_done if args.role == "receiver" else h.blocks_sent
                emit({"event": "progress", "state": h.state.value, "blocks_done": done})
            elif kind == "send_more":
                h = handles[cmd["id"]]
                h.send_blocks(cmd["src"], cmd["first"])
                h.finish()
                h.wait(cmd["timeout"])
                emit(result_of(h))
            elif kind == "connect":
                endpoint.connect(bytes.fromhex(cmd["address"]))
                emit({"event": "connected"})
            elif kind in ("tamper", "garbage"):
                emit({"event": "ok", "alive": lie_on_link(endpoint, cmd)})
            elif kind == "pool_digest":
                emit(
                    {
                        "event": "pool",
                        "digest": hashlib.blake2b(pool.tobytes(), digest_size=16).hexdigest(),
                    }
                )
            elif kind == "nixl_reads":
                agent = endpoint._transport.agent
                n = endpoint._transport.reactor.run_sync(getattr, agent, "outstanding")
                emit({"event": "reads", "outstanding": n})
            elif kind == "stats":
                emit(
                    {
                        "event": "stats",
                        **vars(endpoint.stats),
                        "protocol_errors": endpoint.protocol_errors,
                        "auth_failures": getattr(endpoint, "auth_failures", 0),
                        "dropped_connections": getattr(endpoint, "dropped_connections", 0),
                        "connections": getattr(endpoint, "num_connections", 0),
                        "connections_opened": getattr(endpoint, "connections_opened", 0),
                    }
                )
            else:
                emit({"event": "error", "error": f"unknown command {kind!r}"})
    finally:
        endpoint.close()


if __name__ == "__main__":
    main()

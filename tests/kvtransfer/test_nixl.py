"""KV transfer with the NIXL transport: control over UCX, data pulled by one-sided NIXL reads.

Every NIXL side runs in its own process (``peer.py --kind nixl``), never in the test process:
NIXL ships its own copy of UCX, and with both copies in one process the ucxx copy loses its
registration cache, where UCX 1.21 crashes aborting a rendezvous (as it does with
``UCX_RCACHE_ENABLE=n``); a worker process uses one transport kind, so only this test process
would mix them. Block contents are compared with blake2b digests computed independently.
"""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
from kvt_helpers import Peer, block_digests, freeze, random_pool, small_geometry

from kvtransfer import create_sender

pytestmark = pytest.mark.integration

POOL_BLOCKS = 3000
SECRET = b"fedcba9876543210fedcba9876543210"


@pytest.fixture(scope="module")
def receiver_peer():
    peer = Peer(
        "receiver", small_geometry(), POOL_BLOCKS, "--secret", SECRET.hex(), "--kind", "nixl"
    )
    yield peer
    peer.close()


def nixl_sender(*args: str) -> Peer:
    return Peer("sender", small_geometry(), POOL_BLOCKS, "--kind", "nixl", *args)


@pytest.fixture(scope="module")
def sender():
    """A NIXL sender process whose pool is ``random_pool(POOL_BLOCKS, g, seed=0)``."""
    peer = nixl_sender("--secret", SECRET.hex(), "--settle-timeout", "1.0")
    yield peer
    peer.close()


def send(sender, receiver, tid, src, dst, *, chunk=None, timeout=30.0):
    """Expect on ``receiver``, send from ``sender`` (both peers); both results."""
    assert (
        receiver.request({"cmd": "expect", "id": tid, "blocks": dst, "timeout": timeout})["event"]
        == "expected"
    )
    cmd = {"cmd": "send", "id": tid, "address": receiver.address.hex(), "src": src, "dst": dst}
    sent = sender.request({**cmd, "timeout": timeout, "chunk": chunk}, timeout=timeout + 10)
    got = receiver.request({"cmd": "wait", "id": tid, "timeout": timeout}, timeout=timeout + 10)
    return sent, got


@pytest.mark.parametrize(
    "n,layout,chunk",
    [
        (1, "contiguous", None),
        (7, "scattered", 1),
        (300, "scattered", 37),
        (2500, "contiguous", 500),
    ],
)
def test_random_block_sets_arrive_byte_identical(sender, receiver_peer, n, layout, chunk):
    rng = random.Random(n)
    g = small_geometry()
    if layout == "contiguous":
        s0, d0 = rng.randrange(POOL_BLOCKS - n), rng.randrange(POOL_BLOCKS - n)
        src_ids, dst_ids = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:
        src_ids, dst_ids = rng.sample(range(POOL_BLOCKS), n), rng.sample(range(POOL_BLOCKS), n)
    sent, got = send(sender, receiver_peer, f"nixl-{n}-{layout}", src_ids, dst_ids, chunk=chunk)
    assert sent["state"] == "done" and got["state"] == "done", (sent, got)
    assert got["digests"] == block_digests(random_pool(POOL_BLOCKS, g, seed=0), g, src_ids)


def test_corrupted_copy_fails_only_its_transfer(receiver_peer):
    """A fault-injection copy lies outside the registered pool: it is registered for its one
    message (and announced with its own metadata), and the receiver's checksum catches the
    flipped byte; the clean transfer beside it arrives."""
    g = small_geometry()
    sender = nixl_sender("--secret", SECRET.hex(), "--corrupt", "n-corrupt:3")
    try:
        bad_s, bad = send(
            sender, receiver_peer, "n-corrupt", list(range(10, 18)), list(range(200, 208))
        )
        good_s, good = send(
            sender, receiver_peer, "n-clean", list(range(10, 18)), list(range(300, 308))
        )
        assert bad["state"] == "failed" and bad["error_type"] == "ChecksumMismatchError", bad
        assert "block index 3" in bad["error"]
        assert bad_s["state"] == "failed" and bad_s["error_type"] == "ChecksumMismatchError"
        assert good["state"] == good_s["state"] == "done", (good, good_s)
        src = random_pool(POOL_BLOCKS, g, seed=0)
        assert good["digests"] == block_digests(src, g, list(range(10, 18)))
    finally:
        sender.close()


def test_a_ucx_sender_refuses_a_nixl_address(receiver_peer):
    g = small_geometry()
    ucx = create_sender("ucx", np.zeros(4 * g.block_bytes, np.uint8), g, secret=SECRET)
    try:
        with pytest.raises(ValueError, match="nixl receiver, this sender uses ucx"):
            ucx.open("mixed", receiver_peer.address, [1], 5)
    finally:
        ucx.close()


def test_receiver_killed_mid_transfer_fails_sender_fast():
    g = small_geometry()
    receiver = Peer("receiver", g, 256, "--kind", "nixl")
    sender = nixl_sender("--settle-timeout", "1.0")
    try:
        receiver.request(
            {"cmd": "expect", "id": "doomed", "blocks": list(range(128)), "timeout": 30}
        )
        start = {"cmd": "send", "id": "doomed", "address": receiver.address.hex()}
        start.update(
            src=list(range(64)), dst=list(range(128)), timeout=10.0, finish=False, wait=False
        )
        assert sender.request(start)["event"] == "sending"
        deadline = time.monotonic() + 10
        progress: dict = {}
        while time.monotonic() < deadline:
            progress = sender.request({"cmd": "progress", "id": "doomed"})
            if progress["blocks_done"] == 64:
                break
            time.sleep(0.01)
        assert progress["blocks_done"] == 64, progress
        receiver.kill()
        t = time.monotonic()
        more = {"cmd": "send_more", "id": "doomed", "src": list(range(64, 128)), "first": 64}
        result = sender.request({**more, "timeout": 12}, timeout=20)
        assert result["state"] == "failed" and time.monotonic() - t < 10.0, result
        assert result["error_type"] in ("PeerLostError", "TransferTimeoutError"), result
    finally:
        sender.close()
        receiver.close()


def test_frozen_receiver_times_out_sender():
    g = small_geometry()
    receiver = Peer("receiver", g, 64, "--kind", "nixl")
    sender = nixl_sender("--settle-timeout", "0.5")
    try:
        receiver.request(
            {"cmd": "expect", "id": "frozen", "blocks": list(range(32)), "timeout": 30}
        )
        sender.request({"cmd": "connect", "address": receiver.address.hex()})
        freeze(receiver.proc.pid)
        t = time.monotonic()
        cmd = {"cmd": "send", "id": "frozen", "address": receiver.address.hex()}
        result = sender.request(
            {**cmd, "src": list(range(32)), "dst": list(range(32)), "timeout": 1.0}, timeout=20
        )
        elapsed = time.monotonic() - t
        assert result["state"] == "failed" and result["error_type"] == "TransferTimeoutError", (
            result
        )
        # the 1 s deadline + 0.5 s settle bound, with room for a loaded machine: not hanging
        assert 0.9 < elapsed < 8.0
    finally:
        os.killpg(receiver.proc.pid, signal.SIGCONT)
        sender.close()
        receiver.close()


def test_sender_killed_mid_transfer_fails_receiver_fast(receiver_peer):
    sender_peer = nixl_sender("--secret", SECRET.hex())
    try:
        receiver_peer.request(
            {"cmd": "expect", "id": "orphan", "blocks": list(range(8)), "timeout": 30}
        )
        res = sender_peer.request(
            {
                "cmd": "send",
                "id": "orphan",
                "address": receiver_peer.address.hex(),
                "src": list(range(4)),
                "dst": list(range(8)),
                "timeout": 30,
                "finish": False,
                "wait": False,
            }
        )
        assert res["event"] == "sending"
        deadline = time.monotonic() + 10
        progress = {}
        while time.monotonic() < deadline:
            progress = receiver_peer.request({"cmd": "progress", "id": "orphan"})
            if progress["blocks_done"] == 4:
                break
            time.sleep(0.01)
        assert progress["blocks_done"] == 4, progress
        sender_peer.kill()
        t = time.monotonic()
        result = receiver_peer.request({"cmd": "wait", "id": "orphan", "timeout": 10}, timeout=20)
        assert result["state"] == "failed" and time.monotonic() - t < 5, result
        assert result["error_type"] == "PeerLostError", result
    finally:
        sender_peer.close()


# ---- a sender whose link frames lie ------------------------------------------------------


@pytest.fixture
def sender_peer():
    peer = nixl_sender("--secret", SECRET.hex())
    yield peer
    peer.close()


def _send(sender_peer, receiver_peer, tid, src, dst):
    receiver_peer.request({"cmd": "expect", "id": tid, "blocks": dst, "timeout": 10})
    sent = sender_peer.request(
        {
            "cmd": "send",
            "id": tid,
            "address": receiver_peer.address.hex(),
            "src": src,
            "dst": dst,
            "timeout": 10,
        },
        timeout=20,
    )
    got = receiver_peer.request({"cmd": "wait", "id": tid, "timeout": 10}, timeout=20)
    return sent, got


@pytest.mark.parametrize(
    "mode,expected",
    [("address", "NOT_FOUND"), ("size", "32769 bytes announced for a 32768-byte receive")],
)
def test_a_lying_ready_frame_fails_only_its_transfer(sender_peer, receiver_peer, mode, expected):
    """A READY frame pointing outside the sender's registered pool (NIXL refuses the read)
    or announcing another size (the receiver refuses it) fails that transfer on both sides
    and writes nothing; the connection and later transfers carry on."""
    g = small_geometry()
    zero = block_digests(np.zeros(g.block_bytes, np.uint8), g, [0])[0]
    sender_peer.request({"cmd": "connect", "address": receiver_peer.address.hex()})
    assert sender_peer.request({"cmd": "tamper", "mode": mode})["alive"]
    lie = f"liar-{mode}"
    sent, got = _send(sender_peer, receiver_peer, lie, [1], [2900 + len(mode)])
    assert sent["state"] == "failed" and got["state"] == "failed", (sent, got)
    assert sent["error_type"] == got["error_type"] == "PeerLostError", (sent, got)
    assert expected in sent["error"] and expected in got["error"], (sent, got)
    assert got["digests"] == [zero]  # nothing landed
    honest = f"honest-{mode}"
    sent, got = _send(sender_peer, receiver_peer, honest, [9], [2950 + len(mode)])
    assert sent["state"] == got["state"] == "done", (sent, got)
    src = random_pool(POOL_BLOCKS, g, seed=0)  # the sender's pool (--seed 0)
    assert got["digests"] == block_digests(src, g, [9])
    assert sender_peer.request({"cmd": "stats"})["connections_opened"] == 1


def test_an_undecodable_frame_closes_only_that_link(sender_peer, receiver_peer):
    g = small_geometry()
    sender_peer.request({"cmd": "connect", "address": receiver_peer.address.hex()})
    assert sender_peer.request({"cmd": "garbage"})["alive"] is False
    sent, got = _send(sender_peer, receiver_peer, "after-garbage", [5], [2990])
    assert sent["state"] == got["state"] == "done", (sent, got)
    assert got["digests"] == block_digests(random_pool(POOL_BLOCKS, g, seed=0), g, [5])
    assert sender_peer.request({"cmd": "stats"})["connections_opened"] == 2


def test_a_frozen_senders_reads_never_land_after_the_transfer_settled(monkeypatch):
    """Over TCP (as between hosts without RDMA) a NIXL read needs the sender's progress: with
    the sender frozen mid-transfer the reads stay in flight. Before, the receiver's settle
    timeout closed the link, NIXL's release of the reads returned success, the transfer
    turned terminal, and once the sender ran again the reads' bytes still landed in the pool,
    in blocks that could belong to another request by then. Now the transfer turns terminal
    only once its reads ended, and nothing lands after that."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the peers inherit it
    g = small_geometry()
    n = 2500  # 80 MiB: long enough over TCP to freeze the sender in the middle
    receiver = Peer("receiver", g, n, "--kind", "nixl", "--settle-timeout", "0.5")
    sender = Peer("sender", g, n, "--kind", "nixl", "--seed", "5")
    frozen = False
    try:
        sender.request({"cmd": "connect", "address": receiver.address.hex()})
        receiver.request({"cmd": "expect", "id": "x", "blocks": list(range(n)), "timeout": 1.0})
        cmd = {"cmd": "send", "id": "x", "address": receiver.address.hex()}
        sender.send(
            {**cmd, "src": list(range(n)), "dst": list(range(n)), "timeout": 60}
            | {"finish": False, "wait": False}
        )
        assert sender.read(30)["event"] == "sending"
        deadline = time.monotonic() + 20
        while receiver.request({"cmd": "nixl_reads"})["outstanding"] == 0:
            assert time.monotonic() < deadline, "the receiver never started reading"
        freeze(sender.proc.pid)  # its reads in flight need its progress to go on
        assert receiver.request({"cmd": "nixl_reads"})["outstanding"] > 0, "all read already"
        frozen = True
        # past the 1 s deadline and the 0.5 s settle bound: failed, or not yet settled
        first = receiver.request({"cmd": "wait", "id": "x", "timeout": 4.0}, timeout=20)
        if first["state"] in ("done", "failed", "cancelled"):
            settled_digest = receiver.request({"cmd": "pool_digest"})["digest"]
        os.killpg(sender.proc.pid, signal.SIGCONT)
        frozen = False
        last = receiver.request({"cmd": "wait", "id": "x", "timeout": 20.0}, timeout=40)
        assert last["state"] == "failed", last
        if first["state"] != "failed":
            settled_digest = receiver.request({"cmd": "pool_digest"})["digest"]
        time.sleep(1.0)  # the sender runs again: anything still in flight would land now
        assert receiver.request({"cmd": "pool_digest"})["digest"] == settled_digest, (
            "bytes landed in the pool after the transfer was terminal"
        )
    finally:
        if frozen:
            os.killpg(sender.proc.pid, signal.SIGCONT)
        sender.close()
        receiver.close()

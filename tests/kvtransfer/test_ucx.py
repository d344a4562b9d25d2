"""KV transfer over real UCX between two processes on loopback (TCP).

The test process runs one side in-process; ``peer.py`` runs the other side in a subprocess.
Block contents are compared with blake2b digests computed independently on each side.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
from kvt_helpers import Peer, block_digests, free_port, freeze, random_pool, small_geometry

from kvtransfer import (
    ChecksumMismatchError,
    CorruptBlocks,
    GeometryMismatchError,
    HandshakeError,
    PeerLostError,
    StaleAddressError,
    TransferState,
    TransferTimeoutError,
    create_receiver,
    create_sender,
)
from kvtransfer.protocol import Data, Fin, Hello, Open, ReceiverAddress, encode_ops

pytestmark = pytest.mark.integration

POOL_BLOCKS = 3000
DONE, FAILED = TransferState.DONE, TransferState.FAILED


SECRET = b"0123456789abcdef0123456789abcdef"  # the cluster secret of this module's peers


@pytest.fixture(scope="module")
def receiver_peer():
    peer = Peer("receiver", small_geometry(), POOL_BLOCKS, "--secret", SECRET.hex())
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def src_pool():
    return random_pool(POOL_BLOCKS, small_geometry(), seed=11)


@pytest.fixture
def sender(src_pool):
    s = create_sender("ucx", src_pool, small_geometry(), settle_timeout_s=1.0, secret=SECRET)
    yield s
    s.close()


def push(sender, peer, tid, src_ids, dst_ids, *, chunk=None, timeout=30.0, shuffle_seed=None):
    """Expect on the peer, send from here in chunks (optionally shuffled), wait for both."""
    assert (
        peer.request({"cmd": "expect", "id": tid, "blocks": dst_ids, "timeout": timeout})["event"]
        == "expected"
    )
    sh = sender.open(tid, peer.address, dst_ids, timeout)
    starts = list(range(0, len(src_ids), chunk or len(src_ids)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(starts)
    for i in starts:
        sh.send_blocks(src_ids[i : i + (chunk or len(src_ids))], i)
    sh.finish()
    result = peer.request({"cmd": "wait", "id": tid, "timeout": timeout}, timeout=timeout + 10)
    sh.wait(timeout)
    return sh, result


@pytest.mark.parametrize(
    "n,layout,chunk",
    [
        (1, "contiguous", None),
        (7, "scattered", 1),
        (64, "contiguous", 16),
        (300, "scattered", 37),
        (2500, "contiguous", 500),
        (1500, "scattered", None),
    ],
)
def test_random_block_sets_arrive_byte_identical(sender, receiver_peer, src_pool, n, layout, chunk):
    rng = random.Random(n)
    g = small_geometry()
    if layout == "contiguous":
        s0, d0 = rng.randrange(POOL_BLOCKS - n), rng.randrange(POOL_BLOCKS - n)
        src_ids, dst_ids = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:
        src_ids, dst_ids = rng.sample(range(POOL_BLOCKS), n), rng.sample(range(POOL_BLOCKS), n)
    sh, result = push(
        sender, receiver_peer, f"rand-{n}-{layout}", src_ids, dst_ids, chunk=chunk, shuffle_seed=n
    )
    assert result["state"] == "done", result
    assert sh.state is DONE, sh.error
    assert result["digests"] == block_digests(src_pool, g, src_ids)
    assert result["checksums"] == sh.checksums
    assert sh.bytes_sent == n * g.block_bytes


def test_endpoint_is_reused_across_requests(sender, receiver_peer):
    for j in range(5):
        sh, result = push(sender, receiver_peer, f"reuse-{j}", [j], [100 + j])
        assert result["state"] == "done" and sh.state is DONE
    assert sender.connections_opened == 1


def test_corrupted_bytes_fail_only_that_transfer(src_pool, receiver_peer):
    g = small_geometry()
    sender = create_sender(
        "ucx", src_pool, g, fault_injector=CorruptBlocks({("corrupt", 3)}), secret=SECRET
    )
    try:
        for tid, dst in (("corrupt", list(range(200, 208))), ("clean", list(range(300, 308)))):
            receiver_peer.request({"cmd": "expect", "id": tid, "blocks": dst, "timeout": 20})
        handles = {}
        for tid, dst in (("corrupt", list(range(200, 208))), ("clean", list(range(300, 308)))):
            handles[tid] = sender.open(tid, receiver_peer.address, dst, 20)
            handles[tid].send_blocks(list(range(10, 18)), 0)
            handles[tid].finish()
        bad = receiver_peer.request({"cmd": "wait", "id": "corrupt", "timeout": 20}, timeout=30)
        good = receiver_peer.request({"cmd": "wait", "id": "clean", "timeout": 20}, timeout=30)
        assert bad["state"] == "failed" and bad["error_type"] == "ChecksumMismatchError", bad
        assert "block index 3" in bad["error"]
        assert good["state"] == "done" and good["digests"] == block_digests(
            src_pool, g, list(range(10, 18))
        )
        assert handles["corrupt"].wait(10) is FAILED and isinstance(
            handles["corrupt"].error, ChecksumMismatchError
        )
        assert handles["corrupt"].error.block_index == 3
        assert handles["clean"].wait(10) is DONE
        stats = receiver_peer.request({"cmd": "stats"})
        assert stats["checksum_mismatches_total"] >= 1
    finally:
        sender.close()


def test_geometry_mismatch_is_refused_clearly(receiver_peer):
    g = small_geometry(dtype="fp8", head_dim=64)
    sender = create_sender("ucx", np.zeros(4 * g.block_bytes, np.uint8), g, secret=SECRET)
    try:
        with pytest.raises(GeometryMismatchError) as exc:
            sender.connect(receiver_peer.address, timeout_s=10)
        assert "dtype (sender=float8_e4m3fn, receiver=bfloat16)" in str(exc.value)
        assert "head_dim (sender=64, receiver=32)" in str(exc.value)
    finally:
        sender.close()


def _raw(receiver_peer, payloads, settle=1.0, unframed=False):
    """Run ``payloads`` over a bare UCX connection from a second peer process (see
    ``peer.py``'s ``raw`` command): the replies and whether the receiver closed it."""
    rogue = Peer("sender", small_geometry(), 4)
    try:
        return rogue.request(
            {
                "cmd": "raw",
                "address": receiver_peer.address.hex(),
                "payloads": payloads,
                "settle": settle,
                "unframed": unframed,
            },
            timeout=30,
        )
    finally:
        rogue.close()


def test_malformed_control_messages_to_receiver_are_rejected(sender, receiver_peer, src_pool):
    """A bare UCX client (run by a second peer process) that holds the secret sends garbage
    and out-of-place ops; the receiver answers each with an error op and keeps serving."""
    g = small_geometry()
    payloads = [
        b"\xc1\x00garbage".hex(),
        {"hello": SECRET.hex()},
        encode_ops([Hello(g.to_wire(), True, "rogue", b"n" * 16, b"p" * 32)]).hex(),
        encode_ops([Fin(55, 1)]).hex(),
        encode_ops([Data(66, 0, 1, [0])]).hex(),
    ]
    replies = _raw(receiver_peer, payloads)["ops"]
    kinds = [op["op"] for op in replies]
    assert kinds == ["Challenge", "Error", "HelloOk", "Error", "Error", "Error"], replies
    assert "malformed" in replies[1]["reason"] and "duplicate" in replies[3]["reason"]
    _sh, result = push(sender, receiver_peer, "after-rogue", [1, 2, 3], [400, 401, 402])
    assert result["state"] == "done" and result["digests"] == block_digests(src_pool, g, [1, 2, 3])


def test_a_peer_with_a_wrong_secret_is_refused_and_dropped(sender, receiver_peer, src_pool):
    before = receiver_peer.request({"cmd": "stats"})
    out = _raw(receiver_peer, [{"hello": (b"w" * 32).hex()}, encode_ops([Fin(1, 1)]).hex()])
    kinds = [op["op"] for op in out["ops"]]
    assert kinds == ["Challenge", "Refuse"], out  # nothing answers the fin: it is not read
    assert "authentication failed" in out["ops"][1]["reason"] and out["ops"][1]["geometry"] is None
    assert out["closed"], out  # the receiver closed the connection
    stats = receiver_peer.request({"cmd": "stats"})
    assert stats["auth_failures"] == before["auth_failures"] + 1
    g = small_geometry()
    _sh, result = push(sender, receiver_peer, "after-wrong-secret", [4], [404])
    assert result["state"] == "done" and result["digests"] == block_digests(src_pool, g, [4])


def test_a_sender_without_the_secret_fails_its_handshake(receiver_peer, src_pool):
    stranger = create_sender("ucx", src_pool, small_geometry())
    try:
        with pytest.raises(HandshakeError, match="authentication failed"):
            stranger.connect(receiver_peer.address, timeout_s=10)
    finally:
        stranger.close()


def test_a_peer_that_never_says_hello_is_dropped():
    receiver = Peer(
        "receiver", small_geometry(), 8, "--secret", SECRET.hex(), "--hello-timeout", "0.5"
    )
    try:
        out = _raw(receiver, [], settle=2.0)
        assert [op["op"] for op in out["ops"]] == ["Challenge"] and out["closed"], out
        stats = receiver.request({"cmd": "stats"})
        assert stats["dropped_connections"] == 1 and stats["connections"] == 0
    finally:
        receiver.close()


def test_forged_tags_from_another_connection_land_nowhere(src_pool):
    """UCX matches tags across the receiver's whole worker. A stranger's connection sends
    data messages with every tag the old layout (link | transfer | index) would give the next
    connections' first transfers; they wait in UCX unmatched, and the member's transfer that
    follows receives its own bytes (with the old tags the forged messages matched its posted
    receives and the transfer failed)."""
    g = small_geometry()
    receiver = Peer("receiver", g, 64, "--secret", SECRET.hex())
    member = create_sender("ucx", src_pool, g, secret=SECRET)
    try:
        tags = [
            (link << 48) | (x << 24) | i for link in range(1, 5) for x in range(2) for i in range(3)
        ]
        out = _raw(receiver, [{"tags": tags, "nbytes": 3 * g.block_bytes}], settle=1.0)
        assert out["ops"][0]["op"] == "Challenge"
        _sh, result = push(member, receiver, "victim", [5, 6, 7], [0, 1, 2])
        assert result["state"] == "done", result
        assert result["digests"] == block_digests(src_pool, g, [5, 6, 7])
        assert receiver.request({"cmd": "stats"})["checksum_mismatches_total"] == 0
    finally:
        member.close()
        receiver.close()


def _non_loopback_ipv4() -> str | None:
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def test_a_receiver_bound_to_loopback_closes_connections_on_other_addresses(
    receiver_peer, src_pool
):
    """ucxx listens on the wildcard address; a connection that arrives on an address the
    receiver was not bound to is closed at accept, before anything is read."""
    import dataclasses

    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    addr = ReceiverAddress.decode(receiver_peer.address)
    elsewhere = dataclasses.replace(addr, host=ip).encode()
    member = create_sender("ucx", src_pool, small_geometry(), secret=SECRET)
    try:
        with pytest.raises((PeerLostError, HandshakeError)):
            member.connect(elsewhere, timeout_s=5)
        member.connect(receiver_peer.address, timeout_s=5)  # on the bound address: fine
    finally:
        member.close()


def test_corrupt_frame_closes_only_that_connection(sender, receiver_peer, src_pool):
    """Bytes that are not a valid frame desynchronise the stream: the receiver drops that
    connection (and only that one) and keeps serving."""
    g = small_geometry()
    out = _raw(receiver_peer, [b"GET / HTTP/1.1\r\n\r\n".hex()], settle=1.5, unframed=True)
    # nothing answers the bad frame (the receiver's challenge, sent at accept, may get out
    # before the connection closes)
    assert all(op["op"] == "Challenge" for op in out["ops"]) and out["closed"], out
    _, result = push(sender, receiver_peer, "after-bad-frame", [7], [410])
    assert result["state"] == "done" and result["digests"] == block_digests(src_pool, g, [7])


def test_malformed_control_messages_to_sender_are_rejected():
    """The receiver (here) sends garbage into a live connection from a sender process; the
    sender answers with an error op and its next transfer over the same connection works."""
    g = small_geometry()
    dst = np.zeros(64 * g.block_bytes, np.uint8)
    receiver = create_receiver("ucx", dst, g)
    sender_peer = Peer("sender", g, 64, "--seed", "5")
    try:
        receiver.expect("one", [1], 20)
        res = sender_peer.request(
            {
                "cmd": "send",
                "id": "one",
                "address": receiver.address.hex(),
                "src": [1],
                "dst": [1],
                "timeout": 20,
            },
            timeout=40,
        )
        assert res["state"] == "done", res
        (inlink,) = receiver._links.values()
        receiver._reactor.run_sync(inlink.link.send_ctrl, b"\x92garbage")
        receiver._reactor.run_sync(inlink.link.send_ctrl, encode_ops([Open(3, "y", [1])]))
        time.sleep(0.5)
        receiver.expect("two", [2, 3], 20)
        res = sender_peer.request(
            {
                "cmd": "send",
                "id": "two",
                "address": receiver.address.hex(),
                "src": [2, 3],
                "dst": [2, 3],
                "timeout": 20,
            },
            timeout=40,
        )
        assert res["state"] == "done", res
        assert receiver.protocol_errors == 2  # the sender's two error replies reached us
        assert sender_peer.request({"cmd": "stats"})["protocol_errors"] == 2
        expected = random_pool(64, g, seed=5)
        assert block_digests(dst, g, [1, 2, 3]) == block_digests(expected, g, [1, 2, 3])
    finally:
        sender_peer.close()
        receiver.close()


def test_receiver_killed_mid_transfer_fails_sender_fast(src_pool):
    g = small_geometry()
    peer = Peer("receiver", g, 256)
    sender = create_sender("ucx", src_pool, g, settle_timeout_s=1.0)
    try:
        peer.request({"cmd": "expect", "id": "doomed", "blocks": list(range(128)), "timeout": 30})
        sh = sender.open("doomed", peer.address, list(range(128)), 10.0)
        sh.send_blocks(list(range(64)), 0)
        deadline = time.monotonic() + 10
        while sh.blocks_sent < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sh.blocks_sent == 64, sh
        peer.kill()
        t = time.monotonic()
        sh.send_blocks(list(range(64, 128)), 64)
        sh.finish()
        assert sh.wait(12) is FAILED
        assert (
            time.monotonic() - t < 10.0
        )  # within the transfer's timeout (in practice: immediately)
        assert isinstance(sh.error, (PeerLostError, TransferTimeoutError)), sh.error
        assert sender.stats.failures_total == 1
    finally:
        sender.close()
        peer.close()


def test_frozen_receiver_times_out_sender(src_pool):
    g = small_geometry()
    peer = Peer("receiver", g, 64)
    sender = create_sender("ucx", src_pool, g, settle_timeout_s=0.5)
    try:
        peer.request({"cmd": "expect", "id": "frozen", "blocks": list(range(32)), "timeout": 30})
        sender.connect(peer.address)
        freeze(peer.proc.pid)
        t = time.monotonic()
        sh = sender.open("frozen", peer.address, list(range(32)), 1.0)
        sh.send_blocks(list(range(32)), 0)
        sh.finish()
        assert sh.wait(10) is FAILED
        elapsed = time.monotonic() - t
        assert isinstance(sh.error, TransferTimeoutError), sh.error
        # the 1 s deadline + 0.5 s settle bound, with room for a loaded machine: not hanging
        assert 0.9 < elapsed < 8.0
    finally:
        os.killpg(peer.proc.pid, signal.SIGCONT)
        sender.close()
        peer.close()


def test_sender_killed_mid_transfer_fails_receiver_fast():
    g = small_geometry()
    dst = np.zeros(64 * g.block_bytes, np.uint8)
    receiver = create_receiver("ucx", dst, g)
    sender_peer = Peer("sender", g, 64)
    try:
        rh = receiver.expect("orphan", list(range(8)), 30)
        res = sender_peer.request(
            {
                "cmd": "send",
                "id": "orphan",
                "address": receiver.address.hex(),
                "src": list(range(4)),
                "dst": list(range(8)),
                "timeout": 30,
                "finish": False,
                "wait": False,
            }
        )
        assert res["event"] == "sending"
        deadline = time.monotonic() + 10
        while rh.blocks_done < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        sender_peer.kill()
        t = time.monotonic()
        assert rh.wait(10) is FAILED and time.monotonic() - t < 5
        assert isinstance(rh.error, PeerLostError), rh.error
    finally:
        sender_peer.close()
        receiver.close()


def test_nothing_listening_fails_fast(sender):
    address = ReceiverAddress("ucx", "127.0.0.1", free_port(), "gone").encode()
    t = time.monotonic()
    with pytest.raises(PeerLostError, match="could not connect"):
        sender.connect(address, timeout_s=10)
    h = sender.open("nowhere", address, [1], 10)
    assert h.wait(10) is FAILED and isinstance(h.error, PeerLostError)
    assert time.monotonic() - t < 5


def test_port_in_use_is_a_clear_error():
    g = small_geometry()
    first = create_receiver("ucx", np.zeros(g.block_bytes, np.uint8), g)
    try:
        port = ReceiverAddress.decode(first.address).port
        with pytest.raises(OSError, match=f"cannot listen on port {port}"):
            create_receiver("ucx", np.zeros(g.block_bytes, np.uint8), g, port=port)
    finally:
        first.close()


def test_reconnect_after_receiver_restarts_on_same_port(sender, src_pool):
    g = small_geometry()
    port = free_port()
    first = Peer("receiver", g, 64, "--port", str(port), "--secret", SECRET.hex())
    try:
        _, result = push(sender, first, "before", [1], [1])
        assert result["state"] == "done"
        old_address = first.address
    finally:
        first.kill()
    second = None
    deadline = time.monotonic() + 20
    while second is None:  # the port may linger briefly after the kill
        try:
            second = Peer("receiver", g, 64, "--port", str(port), "--secret", SECRET.hex())
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        with pytest.raises(StaleAddressError):
            sender.connect(old_address, timeout_s=10)
        sh, result = push(sender, second, "after", [2, 3], [4, 5])
        assert result["state"] == "done" and sh.state is DONE, (result, sh.error)
        assert result["digests"] == block_digests(src_pool, g, [2, 3])
        assert sender.connections_opened >= 2
    finally:
        second.close()


def test_a_frozen_receiver_holds_only_its_own_slots_and_window(src_pool):
    """Slots and the in-flight window are per receiver: with one slot and one message in
    flight allowed, a transfer stuck on a frozen receiver does not hold back a transfer to
    another one (it used to wait for the frozen one's deadline)."""
    g = small_geometry()
    frozen, healthy = Peer("receiver", g, 256), Peer("receiver", g, 256)
    sender = create_sender(
        "ucx",
        src_pool,
        g,
        settle_timeout_s=0.5,
        max_active_transfers=1,
        max_inflight_messages=1,
        max_message_bytes=8 * g.block_bytes,
    )
    try:
        blocks = list(range(64))
        for peer, tid in ((frozen, "stuck"), (healthy, "free")):
            peer.request({"cmd": "expect", "id": tid, "blocks": blocks, "timeout": 30})
            sender.connect(peer.address)
        freeze(frozen.proc.pid)
        # a deadline far past the free transfer's own: waiting for it fails that one
        stuck = sender.open("stuck", frozen.address, blocks, 30.0)
        stuck.send_blocks(blocks, 0)
        stuck.finish()

        def in_flight() -> int:  # data messages sent, not completed (read on the reactor)
            return sender._reactor.run_sync(
                lambda: sum(c.inflight_msgs for c in sender._conns.values())
            )

        deadline = time.monotonic() + 10
        while in_flight() < 1:  # its first (rendezvous) message is in flight, never completing
            assert time.monotonic() < deadline, "the stuck transfer never sent"
            time.sleep(0.01)
        t0 = time.monotonic()
        free = sender.open("free", healthy.address, blocks, 10.0)
        free.send_blocks(blocks, 0)
        free.finish()
        assert free.wait(10.0) is DONE, free.error
        assert time.monotonic() - t0 < 8.0  # not held until the stuck one's 30 s deadline
        assert healthy.request({"cmd": "wait", "id": "free", "timeout": 10})["state"] == "done"
        assert not stuck.done
    finally:
        os.killpg(frozen.proc.pid, signal.SIGCONT)
        sender.close()
        frozen.close()
        healthy.close()


@pytest.mark.parametrize("who_closes", ["peer", "self"])
def test_a_receive_posted_for_a_peer_that_leaves_completes(who_closes):
    """A receive posted on a connection whose peer goes away (or that this side closes)
    completes with an error at once. When the peer left first, ucxx's endpoint error handler
    moved the receive to the worker's to-cancel list, which nothing drained: the receive
    never completed, so a KV transfer cancelled after its prefill worker died never settled
    (the decode worker then failed the request; seen in CI as
    test_prefill_killed_midprefill_falls_back)."""
    from kvtransfer.pool import Region
    from kvtransfer.protocol import ReceiverAddress
    from kvtransfer.ucx import UcxTransport

    a, b = UcxTransport(name="a"), UcxTransport(name="b")
    accepted, closed, received = [], threading.Event(), threading.Event()
    errors: list[BaseException | None] = []

    def on_accept(link):
        link.on_ctrl = lambda _payload: None
        link.on_closed = lambda _error: closed.set()
        link.start()
        accepted.append(link)

    def connect():
        link = b.connect(ReceiverAddress("ucx", host, port, "x"))
        link.on_ctrl = lambda _payload: None
        link.on_closed = lambda _error: None
        link.start()
        link.send_ctrl(b"hello")  # the connection is accepted once something arrives

    def on_received(error):
        errors.append(error)
        received.set()

    try:
        host, port = a.reactor.run_sync(lambda: a.listen("127.0.0.1", 0, on_accept))
        b.reactor.run_sync(connect)
        deadline = time.monotonic() + 10
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted, "the connection was not accepted"
        buf = np.zeros(64 * 1024, np.uint8)  # above the eager limit: a rendezvous receive
        region = Region(0, 1, buf.nbytes, buf, False)
        a.reactor.run_sync(lambda: accepted[0].recv_data(12345, region, on_received))
        if who_closes == "peer":
            b.close()
            assert closed.wait(10), "the peer's close was not noticed"
        else:
            a.reactor.run_sync(accepted[0].close)
        assert received.wait(5), "the posted receive never completed"
        assert errors[0] is not None
        assert a.reactor.run_sync(lambda: a.worker.outstanding) == 0
    finally:
        b.close()
        a.close()

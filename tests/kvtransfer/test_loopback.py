"""The transfer protocol end to end over the in-process loopback transport.

The loopback runs the same sender/receiver state machines as UCX, so these tests cover the
protocol (coalescing, checksums, handshake, timeouts, cancellation, backpressure, reconnects,
malformed messages); test_ucx.py repeats the essentials across real processes.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch
from kvt_helpers import block_bytes_of, random_pool, small_geometry
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer import (
    ChecksumMismatchError,
    CorruptBlocks,
    GeometryMismatchError,
    IncompleteTransferError,
    LoopbackNetwork,
    PeerCancelledError,
    PeerLostError,
    TransferCancelledError,
    TransferMetrics,
    TransferRejectedError,
    TransferState,
    TransferTimeoutError,
    TransportClosedError,
    create_receiver,
    create_sender,
)
from kvtransfer.loopback import LoopbackLink
from kvtransfer.protocol import Data, decode_ops, encode_ops

pytestmark = pytest.mark.unit

DONE, FAILED, CANCELLED = TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED


def run_transfer(
    sender, receiver, tid, src_ids, dst_ids, *, chunk=None, shuffle=False, timeout=10.0
):
    rh = receiver.expect(tid, dst_ids, timeout)
    sh = sender.open(tid, receiver.address, dst_ids, timeout)
    positions = list(range(len(src_ids)))
    pieces = [
        positions[i : i + (chunk or len(positions))]
        for i in range(0, len(positions), chunk or len(positions))
    ]
    if shuffle:
        random.Random(tid).shuffle(pieces)
    for piece in pieces:
        sh.send_blocks([src_ids[i] for i in piece], piece[0])
    sh.finish()
    assert rh.wait(timeout + 5) == DONE, rh.error
    assert sh.wait(timeout + 5) == DONE, sh.error
    return sh, rh


def assert_blocks_equal(src, dst, g, src_ids, dst_ids):
    for s, d in zip(src_ids, dst_ids):
        assert block_bytes_of(src, g, s) == block_bytes_of(dst, g, d), (s, d)


@pytest.mark.parametrize("seed", range(6))
def test_random_block_sets_arrive_identical(loopback_pair, geometry, seed):
    rng = random.Random(seed)
    sender, receiver, src, dst = loopback_pair(num_src=300, num_dst=300, seed=seed)
    n = rng.choice([1, 2, 17, 64, 299])
    if seed % 2:  # contiguous runs
        s0, d0 = rng.randrange(300 - n + 1), rng.randrange(300 - n + 1)
        src_ids, dst_ids = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:  # scattered
        src_ids, dst_ids = rng.sample(range(300), n), rng.sample(range(300), n)
    untouched = np.setdiff1d(np.arange(300), dst_ids)
    sh, rh = run_transfer(
        sender, receiver, f"t{seed}", src_ids, dst_ids, chunk=rng.choice([1, 5, None]), shuffle=True
    )
    assert_blocks_equal(src, dst, geometry, src_ids, dst_ids)
    assert all(block_bytes_of(dst, geometry, b) == bytes(geometry.block_bytes) for b in untouched)
    assert sh.checksums == rh.checksums and None not in sh.checksums
    assert sh.bytes_sent == rh.bytes_received == n * geometry.block_bytes
    assert rh.blocks_done == sh.blocks_sent == n


def test_thousands_of_blocks_in_torch_bf16_pools():
    g = small_geometry()
    net = LoopbackNetwork()
    src = torch.randn(2100, *g.block_shape).to(torch.bfloat16)
    dst = torch.zeros(2100, *g.block_shape, dtype=torch.bfloat16)
    receiver = create_receiver("loopback", dst, g, network=net)
    sender = create_sender("loopback", src, g, network=net, max_message_bytes=1 << 20)
    try:
        ids = list(range(2048))
        dst_ids = ids[1024:] + ids[:1024]
        run_transfer(sender, receiver, "big", ids, dst_ids, chunk=100)
        assert torch.equal(dst[dst_ids].view(torch.uint8), src[ids].view(torch.uint8))
    finally:
        sender.close()
        receiver.close()


def test_adjacent_blocks_are_coalesced(loopback_pair, monkeypatch):
    headers = []
    original = LoopbackLink.send_ctrl

    def spy(self, payload):
        headers.extend(op for op in decode_ops(payload) if isinstance(op, Data))
        return original(self, payload)

    monkeypatch.setattr(LoopbackLink, "send_ctrl", spy)
    sender, receiver, _src, _dst = loopback_pair(sender_opts={"max_message_bytes": 8 * 32768})
    # positions 0-9 adjacent in both pools, 10 breaks the destination run, 11-12 adjacent again
    src_ids = list(range(20, 33))
    dst_ids = list(range(10)) + [40] + [50, 51]
    run_transfer(sender, receiver, "c", src_ids, dst_ids)
    assert [(h.index, h.count) for h in headers] == [(0, 8), (8, 2), (10, 1), (11, 2)]


def test_send_blocks_and_finish_validate_input(loopback_pair):
    sender, receiver, _, _ = loopback_pair()
    rh = receiver.expect("v", [1, 2, 3], 5)
    sh = sender.open("v", receiver.address, [1, 2, 3], 5)
    with pytest.raises(ValueError):
        sh.send_blocks([64], 0)  # outside the sender's pool
    with pytest.raises(ValueError):
        sh.send_blocks([1, 2], 2)  # positions 2..3 outside a 3-block transfer
    with pytest.raises(TypeError):
        sh.send_blocks([1], "0")  # type: ignore[arg-type]
    sh.send_blocks([5], 1)
    with pytest.raises(ValueError, match="already queued"):
        sh.send_blocks([6], 1)
    with pytest.raises(IncompleteTransferError, match="2 of 3"):
        sh.finish()
    sh.send_blocks([4], 0)
    sh.send_blocks([9], 2)
    sh.finish()
    with pytest.raises(ValueError, match="after finish"):
        sh.send_blocks([1], 0)
    assert sh.wait(5) == DONE and rh.wait(5) == DONE
    receiver.expect("w", [1], 5)
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("w", [2], 5)
    with pytest.raises(ValueError, match="repeat"):
        receiver.expect("x", [3, 3], 5)
    with pytest.raises(ValueError):
        receiver.expect("y", [64], 5)
    with pytest.raises(ValueError):
        sender.open("z", receiver.address, [1], 0)


def test_geometry_mismatch_is_refused_naming_both_sides(loopback_pair, geometry):
    sender, receiver, _, _ = loopback_pair(src_geometry=small_geometry(dtype="fp8", num_kv_heads=8))
    with pytest.raises(GeometryMismatchError) as exc:
        sender.connect(receiver.address, timeout_s=5)
    msg = str(exc.value)
    assert "dtype (sender=float8_e4m3fn, receiver=bfloat16)" in msg
    assert "num_kv_heads (sender=8, receiver=4)" in msg
    receiver.expect("g", [0], 5)
    sh = sender.open("g", receiver.address, [0], 5)
    assert sh.wait(5) == FAILED and isinstance(sh.error, GeometryMismatchError)
    # the receiver keeps serving compatible senders
    good = create_sender(
        "loopback",
        np.zeros(4 * geometry.block_bytes, np.uint8),
        geometry,
        network=receiver._transport.network,
    )
    try:
        good.connect(receiver.address)
        receiver.expect("ok", [1], 5)
        h = good.open("ok", receiver.address, [1], 5)
        h.send_blocks([0], 0)
        h.finish()
        assert h.wait(5) == DONE
    finally:
        good.close()


def test_checksum_mismatch_fails_that_transfer_only(loopback_pair, geometry):
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    sender, receiver, src, dst = loopback_pair(
        sender_opts={"fault_injector": CorruptBlocks({("bad", 2)}), "metrics": metrics},
        receiver_opts={"metrics": metrics},
    )
    rb = receiver.expect("bad", [10, 11, 12, 13], 5)
    rg = receiver.expect("good", [20, 21, 22, 23], 5)
    sb = sender.open("bad", receiver.address, [10, 11, 12, 13], 5)
    sg = sender.open("good", receiver.address, [20, 21, 22, 23], 5)
    for h in (sb, sg):
        h.send_blocks([0, 1, 2, 3], 0)
        h.finish()
    assert rb.wait(5) == FAILED and sb.wait(5) == FAILED
    for err in (rb.error, sb.error):
        assert isinstance(err, ChecksumMismatchError) and err.block_index == 2
    assert rb.error.expected == sb.checksums[2] != rb.error.actual
    assert rg.wait(5) == DONE and sg.wait(5) == DONE
    assert_blocks_equal(src, dst, geometry, [0, 1, 2, 3], [20, 21, 22, 23])
    assert metrics.recv.checksum_mismatches_total == 1 and metrics.recv.failures_total == 1
    assert metrics.send.transfers_total == metrics.recv.transfers_total == 1
    text = generate_latest(registry).decode()
    assert 'pdserve:kv_transfer_failures_total{direction="recv",reason="checksum"} 1.0' in text
    # the connection survived: another transfer still works
    run_transfer(sender, receiver, "after", [5], [30])


def test_checksums_computed_off_the_io_thread(loopback_pair, geometry):
    """With inline_checksum_bytes=0 every run is hashed on the checksum threads and its sums
    follow the data in a separate op; corruption is still caught per block."""
    offload = {"inline_checksum_bytes": 0, "checksum_threads": 2}
    sender, receiver, src, dst = loopback_pair(
        num_src=128,
        num_dst=128,
        receiver_opts=offload,
        sender_opts={
            **offload,
            "fault_injector": CorruptBlocks({("bad", 40)}),
            "max_message_bytes": 8 * 32768,
        },
    )
    ids = list(range(64))
    sh, rh = run_transfer(sender, receiver, "good", ids, [i + 64 for i in ids], chunk=24)
    assert_blocks_equal(src, dst, geometry, ids, [i + 64 for i in ids])
    assert sh.checksums == rh.checksums and None not in rh.checksums
    rb = receiver.expect("bad", ids, 5)
    sb = sender.open("bad", receiver.address, ids, 5)
    sb.send_blocks(ids, 0)
    sb.finish()
    assert rb.wait(5) == FAILED and sb.wait(5) == FAILED
    assert rb.error.block_index == 40 == sb.error.block_index


def test_checksums_off_on_both_sides(loopback_pair, geometry):
    sender, receiver, src, dst = loopback_pair(
        sender_opts={"checksums": False}, receiver_opts={"verify_checksums": False}
    )
    sh, rh = run_transfer(sender, receiver, "nock", [1, 2], [3, 4])
    assert sh.checksums == [None, None] == rh.checksums
    assert_blocks_equal(src, dst, geometry, [1, 2], [3, 4])


def _wait_until(condition, timeout: float = 5.0) -> None:
    """Poll ``condition`` (state another thread changes) until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_late_checksums_to_a_receiver_not_checking_them_count_once(
    loopback_pair, geometry, monkeypatch
):
    """A receiver with checking off (``--no-kv-checksums``) and a sender with checksums on: a
    run's checksums that follow in a ``sums`` op after its data arrived counted its blocks a
    second time, so the count never matched the transfer's size and it timed out with every
    byte in place. The sender's checksum jobs are held here until the receiver holds every
    byte, which fixes that order (the race the review reproduced on 2 MiB blocks)."""
    sender, receiver, src, dst = loopback_pair(
        sender_opts={"inline_checksum_bytes": 0, "max_message_bytes": 2 * geometry.block_bytes},
        receiver_opts={"verify_checksums": False},
    )
    held: list = []
    submit = sender._checksummer.submit
    monkeypatch.setattr(sender._checksummer, "submit", lambda *job: held.append(job))
    ids = [10, 11, 12, 13]
    rh = receiver.expect("late-sums", ids, 3)
    sh = sender.open("late-sums", receiver.address, ids, 3)
    sh.send_blocks([0, 1, 2, 3], 0)
    sh.finish()
    _wait_until(lambda: rh.bytes_received == 4 * geometry.block_bytes)
    assert rh.bytes_received == 4 * geometry.block_bytes and len(held) == 2
    assert rh.blocks_done == 4 and not rh.done  # no 'fin' before the checksums
    for job in held:
        sender._reactor.call_soon_threadsafe(submit, *job)
    assert rh.wait(5) == DONE and sh.wait(5) == DONE, (rh.error, sh.error)
    assert rh.blocks_done == 4
    assert rh.checksums == sh.checksums and None not in rh.checksums
    assert_blocks_equal(src, dst, geometry, [0, 1, 2, 3], ids)


def test_no_order_of_data_sums_and_fin_counts_a_message_twice(loopback_pair, geometry):
    """With block 0's data and then its checksums in, and ``fin`` sent, a receiver not
    checking checksums must not answer ``done`` while block 1 is still on its way: counting
    block 0 twice made the count whole (a raw peer fixes the order)."""
    from kvtransfer.pool import PoolView
    from kvtransfer.protocol import Done, Fin, Open, Sums

    _, receiver, _, dst = loopback_pair(receiver_opts={"verify_checksums": False})
    replies: list = []
    transport, link, tag = _ready_raw_link(receiver, geometry, replies)
    try:
        run = transport.reactor.run_sync
        src = random_pool(2, geometry, seed=5)
        view = PoolView(src, geometry)
        sums = view.checksums(view.region(0, 2))
        rh = receiver.expect("ordered", [20, 21], 5)
        announce = [Open(0, "ordered", [20, 21]), Data(0, 0, 1, None), Data(0, 1, 1, None)]
        run(link.send_ctrl, encode_ops(announce))
        run(link.send_data, tag(0, 0), view.region(0, 1), _ignore)
        _wait_until(lambda: rh.bytes_received == geometry.block_bytes)
        assert rh.blocks_done == 1
        run(link.send_ctrl, encode_ops([Sums(0, 0, sums[:1]), Fin(0, 2)]))
        _round_trip(transport, link, replies)
        assert not any(isinstance(op, Done) for op in replies), replies
        assert rh.blocks_done == 1 and not rh.done
        run(link.send_data, tag(0, 1), view.region(1, 1), _ignore)
        assert rh.wait(5) == DONE, rh.error
        assert rh.blocks_done == 2 and rh.checksums == [sums[0], None]
        _wait_until(lambda: isinstance(replies[-1], Done))
        assert replies[-1] == Done(0)
        assert_blocks_equal(src, dst, geometry, [0, 1], [20, 21])
    finally:
        transport.close()


def _ignore(_error) -> None:
    """Completion of a raw peer's data send."""


def test_sender_without_checksums_is_refused_by_verifying_receiver(loopback_pair):
    sender, receiver, _, _ = loopback_pair(sender_opts={"checksums": False})
    with pytest.raises(GeometryMismatchError, match=r"checksums \(sender=off, receiver=on\)"):
        sender.connect(receiver.address)


def test_receiver_timeout_when_sender_never_opens(loopback_pair):
    _, receiver, _, dst = loopback_pair()
    t = time.monotonic()
    rh = receiver.expect("late", [1, 2], 0.3)
    assert rh.wait(5) == FAILED
    assert 0.25 < time.monotonic() - t < 2.0
    assert isinstance(rh.error, TransferTimeoutError) and "never opened" in str(rh.error)
    assert not dst.any()


def test_sender_timeout_and_receiver_told(loopback_pair):
    sender, receiver, _, _dst = loopback_pair()
    rh = receiver.expect("slow", [1, 2], 10)
    sh = sender.open("slow", receiver.address, [1, 2], 0.3)
    sh.send_blocks([7], 0)  # never finishes
    t = time.monotonic()
    assert sh.wait(5) == FAILED and time.monotonic() - t < 2.0
    assert isinstance(sh.error, TransferTimeoutError)
    assert rh.wait(5) == FAILED and isinstance(rh.error, PeerCancelledError)


def test_unknown_transfer_is_rejected(loopback_pair):
    sender, receiver, _, _ = loopback_pair()
    sh = sender.open("nobody-expects", receiver.address, [1], 5)
    sh.send_blocks([1], 0)
    sh.finish()
    assert sh.wait(5) == FAILED
    assert isinstance(sh.error, TransferRejectedError) and sh.error.code == "unknown_transfer"


def test_different_destination_ids_are_rejected_and_pool_untouched(loopback_pair):
    sender, receiver, _, dst = loopback_pair()
    rh = receiver.expect("d", [1, 2], 5)
    sh = sender.open("d", receiver.address, [1, 3], 5)
    sh.send_blocks([0, 1], 0)
    sh.finish()
    assert rh.wait(5) == FAILED and sh.wait(5) == FAILED
    assert sh.error.code == "mismatch"
    assert not dst.any()


def test_receiver_cancel_mid_transfer(loopback_pair, geometry):
    sender, receiver, _src, dst = loopback_pair(num_dst=64)
    dst_ids = list(range(8, 16))
    rh = receiver.expect("rc", dst_ids, 5)
    sh = sender.open("rc", receiver.address, dst_ids, 5)
    sh.send_blocks([0, 1, 2], 0)
    deadline = time.monotonic() + 5
    while rh.blocks_done < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    rh.cancel()
    assert rh.wait(5) == CANCELLED and isinstance(rh.error, TransferCancelledError)
    sh.send_blocks([3, 4, 5, 6, 7], 3)
    sh.finish()
    assert sh.wait(5) == FAILED and isinstance(sh.error, PeerCancelledError)
    outside = np.concatenate([dst[: 8 * geometry.block_bytes], dst[16 * geometry.block_bytes :]])
    assert not outside.any()


def test_sender_cancel(loopback_pair):
    sender, receiver, _, _ = loopback_pair()
    rh = receiver.expect("sc", [1, 2], 5)
    sh = sender.open("sc", receiver.address, [1, 2], 5)
    sh.send_blocks([0], 0)
    sh.cancel()
    assert sh.wait(5) == CANCELLED and isinstance(sh.error, TransferCancelledError)
    assert rh.wait(5) == FAILED and isinstance(rh.error, PeerCancelledError)
    sh.send_blocks([1], 1)  # ignored after the handle is terminal
    sh.cancel()


def test_bounded_active_transfers_queue_in_order(loopback_pair):
    sender, receiver, _, _ = loopback_pair(
        sender_opts={"max_active_transfers": 1, "max_inflight_messages": 1}
    )
    r1, r2 = receiver.expect("q1", [1], 5), receiver.expect("q2", [2], 5)
    s1 = sender.open("q1", receiver.address, [1], 5)
    s2 = sender.open("q2", receiver.address, [2], 5)
    # the reactor thread updates the counters: wait for them, bounded
    _wait_until(lambda: sender.active_transfers == 1 and sender.queued_transfers == 1)
    assert sender.active_transfers == 1 and sender.queued_transfers == 1
    s2.send_blocks([5], 0)
    s2.finish()
    time.sleep(0.1)  # a window for a regression to start the queued transfer early
    assert s2.state is TransferState.PENDING and r2.blocks_done == 0
    s1.send_blocks([4], 0)
    s1.finish()
    assert s1.wait(5) == DONE and s2.wait(5) == DONE and r1.wait(5) == DONE and r2.wait(5) == DONE


def test_many_concurrent_transfers_share_one_connection(loopback_pair, geometry):
    sender, receiver, src, dst = loopback_pair(
        num_src=64,
        num_dst=256,
        receiver_opts={"max_posted_receives": 2},
        sender_opts={"max_inflight_messages": 3},
    )
    handles = []
    for j in range(32):
        dst_ids = [j * 8 + i for i in range(0, 8, 2)]  # scattered: one message per block
        handles.append(
            (
                receiver.expect(f"m{j}", dst_ids, 10),
                sender.open(f"m{j}", receiver.address, dst_ids, 10),
            )
        )
    for j, (_, sh) in enumerate(handles):
        sh.send_blocks([j, j + 1, j + 2, j + 3], 0)
        sh.finish()
    for j, (rh, sh) in enumerate(handles):
        assert rh.wait(10) == DONE and sh.wait(10) == DONE, (rh.error, sh.error)
        assert_blocks_equal(src, dst, geometry, [j, j + 1, j + 2, j + 3], list(rh.block_ids))
    assert sender.connections_opened == 1 and receiver.num_connections == 1


def test_a_frozen_sender_holds_only_its_own_posted_receives(loopback_pair, geometry):
    """Posted receives are counted per connection: a prefill worker that stopped after its data
    headers went out (frozen: their data never comes) holds only its own, and a healthy
    sender's transfers into the same decode worker go through. They used to share
    ``max_posted_receives`` with it and wait for its transfers' deadline."""
    from kvtransfer.protocol import Open

    sender, receiver, src, dst = loopback_pair(receiver_opts={"max_posted_receives": 2})
    replies: list = []
    transport, link, _ = _ready_raw_link(receiver, geometry, replies)
    try:
        frozen = [receiver.expect(f"frozen{j}", [40 + j], 60) for j in range(3)]
        ops = [op for j in range(3) for op in (Open(j, f"frozen{j}", [40 + j]), Data(j, 0, 1, [0]))]
        transport.reactor.run_sync(link.send_ctrl, encode_ops(ops))
        _round_trip(transport, link, replies)  # two receives posted, the third header waits
        scattered = [0, 2, 4, 6]  # four messages through two receive slots
        run_transfer(sender, receiver, "healthy", [8, 9, 10, 11], scattered, timeout=5)
        run_transfer(sender, receiver, "healthy-too", [12], [20], timeout=5)
        assert_blocks_equal(src, dst, geometry, [8, 9, 10, 11, 12], [*scattered, 20])
        assert not any(h.done for h in frozen)
    finally:
        transport.close()
    for h in frozen:
        assert h.wait(5) == FAILED and isinstance(h.error, PeerLostError)


def test_a_transfer_ended_with_headers_waiting_settles_at_once(loopback_pair, geometry):
    """A transfer decided while one of its data headers waits for a receive slot settles once
    its posted receives complete. The waiting header used to count as posted, so the transfer
    could not settle until a slot freed, and past ``settle_timeout_s`` the receiver closed the
    connection and failed the sender's other transfers. Its data is read and discarded."""
    from kvtransfer.pool import PoolView
    from kvtransfer.protocol import Fail, Fin, Open

    _, receiver, _, dst = loopback_pair(
        receiver_opts={"max_posted_receives": 1, "settle_timeout_s": 60}
    )
    replies: list = []
    transport, link, tag = _ready_raw_link(receiver, geometry, replies)
    try:
        run = transport.reactor.run_sync
        src = random_pool(2, geometry, seed=7)
        view = PoolView(src, geometry)
        sums = view.checksums(view.region(0, 2))
        first = receiver.expect("first", [1], 10)
        second = receiver.expect("second", [2], 10)
        ops = [Open(0, "first", [1]), Data(0, 0, 1, sums[:1])]
        ops += [Open(1, "second", [2]), Data(1, 0, 1, sums[1:])]
        run(link.send_ctrl, encode_ops(ops))
        _round_trip(transport, link, replies)  # first's receive is posted, second's waits
        second.cancel()
        assert second.wait(5) == CANCELLED
        _wait_until(lambda: any(isinstance(op, Fail) for op in replies))
        assert [(op.x, op.code) for op in replies if isinstance(op, Fail)] == [(1, "cancelled")]
        discarded = threading.Event()
        run(link.send_data, tag(1, 0), view.region(1, 1), lambda _error: discarded.set())
        assert discarded.wait(5)  # read and thrown away, not left waiting in the transport
        run(link.send_data, tag(0, 0), view.region(0, 1), _ignore)
        run(link.send_ctrl, encode_ops([Fin(0, 1)]))
        assert first.wait(5) == DONE, first.error
        assert_blocks_equal(src, dst, geometry, [0], [1])
        assert not dst[2 * geometry.block_bytes : 3 * geometry.block_bytes].any()
        assert receiver.num_connections == 1
    finally:
        transport.close()


def test_reconnect_after_receiver_restart(geometry):
    net = LoopbackNetwork()
    src = np.random.default_rng(3).integers(0, 256, 8 * geometry.block_bytes, dtype=np.uint8)
    sender = create_sender("loopback", src, geometry, network=net)
    first = create_receiver("loopback", np.zeros_like(src), geometry, network=net)
    try:
        run_transfer(sender, first, "a", [1], [1])
        rh = first.expect("b", [2, 3], 5)
        sh = sender.open("b", first.address, [2, 3], 5)
        sh.send_blocks([2], 0)
        first.close()  # the receiver "dies" mid-transfer
        assert sh.wait(5) == FAILED and isinstance(sh.error, (PeerLostError, TransportClosedError))
        assert rh.state is FAILED
        second_pool = np.zeros_like(src)
        second = create_receiver("loopback", second_pool, geometry, network=net)
        try:
            run_transfer(sender, second, "c", [4, 5], [6, 7])
            assert (
                second_pool[6 * geometry.block_bytes : 8 * geometry.block_bytes].tobytes()
                == src[4 * geometry.block_bytes : 6 * geometry.block_bytes].tobytes()
            )
            assert sender.connections_opened == 2
        finally:
            second.close()
    finally:
        sender.close()


def test_a_stale_address_fails_only_its_own_transfer(geometry):
    """The decode worker restarted on the same port and the sender holds a ready connection to
    the new instance: an open naming the old instance used to close that connection as
    "restarted" and fail every healthy transfer on it. Now only the stale open fails."""
    from kvtransfer.errors import StaleAddressError

    net = LoopbackNetwork()
    src = random_pool(16, geometry, seed=3)
    old = create_receiver("loopback", np.zeros_like(src), geometry, network=net)
    old_address, port = old.address, old._address.port
    old.close()
    dst = np.zeros_like(src)
    new = create_receiver("loopback", dst, geometry, network=net, port=port)
    sender = create_sender("loopback", src, geometry, network=net)
    try:
        rh = new.expect("healthy", [1, 2, 3], 10)
        sh = sender.open("healthy", new.address, [1, 2, 3], 10)
        sh.send_blocks([5], 0)
        _wait_until(lambda: rh.blocks_done == 1)
        assert rh.blocks_done == 1  # the connection to the new instance is ready and in use
        stale = sender.open("stale", old_address, [7], 10)
        assert stale.wait(5) == FAILED and isinstance(stale.error, StaleAddressError)
        sh.send_blocks([6, 7], 1)
        sh.finish()
        assert sh.wait(5) == DONE and rh.wait(5) == DONE, (sh.error, rh.error)
        assert_blocks_equal(src, dst, geometry, [5, 6, 7], [1, 2, 3])
        with pytest.raises(StaleAddressError):
            sender.connect(old_address, timeout_s=5)
        run_transfer(sender, new, "after", [8], [4])  # still on the first connection
        assert new.num_connections == 1
    finally:
        sender.close()
        new.close()


def test_a_proven_new_instance_replaces_the_connection_to_the_old_one(geometry):
    """The receiver restarted but the sender has not noticed (its connection to the old
    instance looks ready, as a UCX endpoint to a frozen or vanished host does): an open naming
    the new instance connects, and once the handshake proves that instance the connection to
    the old one is closed and its transfers fail at once instead of at their deadline."""
    net = LoopbackNetwork()
    src = random_pool(8, geometry, seed=3)
    old = create_receiver("loopback", np.zeros_like(src), geometry, network=net)
    sender = create_sender("loopback", src, geometry, network=net)
    new = None
    try:
        old.expect("orphan", [1, 2], 30)
        orphan = sender.open("orphan", old.address, [1, 2], 30)
        orphan.send_blocks([1], 0)
        sender.connect(old.address)
        port = old._address.port
        net.unbind(port)  # the old instance stops listening, its connection stays up
        dst = np.zeros_like(src)
        new = create_receiver("loopback", dst, geometry, network=net, port=port)
        run_transfer(sender, new, "fresh", [4, 5], [6, 7])
        assert orphan.wait(5) == FAILED and isinstance(orphan.error, PeerLostError)
        assert "restarted" in str(orphan.error)
        assert_blocks_equal(src, dst, geometry, [4, 5], [6, 7])
        assert sender.connections_opened == 2
    finally:
        sender.close()
        if new is not None:
            new.close()
        old.close()


def _raw_link(network: LoopbackNetwork, receiver, replies: list):
    from kvtransfer.loopback import LoopbackTransport
    from kvtransfer.protocol import ReceiverAddress

    transport = LoopbackTransport(network, name="raw")

    def setup():
        link = transport.connect(ReceiverAddress.decode(receiver.address))
        link.on_ctrl = lambda p: replies.extend(decode_ops(p))
        link.on_closed = lambda e: None
        link.start()
        return link

    return transport, transport.reactor.run_sync(setup)


def _wait_for(replies: list, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while len(replies) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def _hello(replies: list, geometry, secret: bytes | None):
    """The hello a sender holding ``secret`` answers the receiver's challenge with."""
    from kvtransfer.auth import hello_proof, new_nonce
    from kvtransfer.protocol import Challenge, Hello

    _wait_for(replies, 1)
    assert isinstance(replies[0], Challenge), replies
    nonce = new_nonce()
    mac = hello_proof(secret, replies[0].nonce, nonce, "raw")
    return Hello(geometry.to_wire(), True, "raw", nonce, mac)


def _ready_raw_link(receiver, geometry, replies: list):
    """A raw peer past the handshake: (transport, link, its data tag function)."""
    from kvtransfer.auth import TagCipher
    from kvtransfer.protocol import HelloOk, data_tag

    transport, link = _raw_link(receiver._transport.network, receiver, replies)
    transport.reactor.run_sync(link.send_ctrl, encode_ops([_hello(replies, geometry, None)]))
    _wait_for(replies, 2)
    ok = replies[1]
    assert isinstance(ok, HelloOk), replies
    cipher = TagCipher(ok.tag_key)
    return transport, link, lambda x, index: data_tag(cipher, ok.link_id, x, index)


def _round_trip(transport, link, replies: list) -> None:
    """Return once the receiver has handled everything sent on ``link`` so far: it answers a
    ``fin`` for an unknown transfer number with an error, after whatever came before."""
    from kvtransfer.protocol import Error, Fin

    n = len(replies)
    transport.reactor.run_sync(link.send_ctrl, encode_ops([Fin(99999, 1)]))
    _wait_until(lambda: any(isinstance(op, Error) for op in replies[n:]))
    assert isinstance(replies[-1], Error) and "99999" in replies[-1].reason, replies[n:]


def test_malformed_and_unexpected_messages_to_receiver_are_rejected(loopback_pair, geometry):
    from kvtransfer.protocol import Challenge, Done, Error, Fin, HelloOk

    sender, receiver, src, dst = loopback_pair()
    replies: list = []
    transport, link = _raw_link(receiver._transport.network, receiver, replies)
    try:

        def send(payload):
            return transport.reactor.run_sync(link.send_ctrl, payload)

        hello = _hello(replies, geometry, None)
        send(b"\x00garbage")
        send(encode_ops([hello]))
        send(encode_ops([hello]))  # duplicate
        send(encode_ops([Done(9), Fin(77, 1)]))  # receiver-bound 'done', fin for unknown transfer
        _wait_for(replies, 6)
        kinds = [type(op).__name__ for op in replies]
        assert kinds == ["Challenge", "Error", "HelloOk", "Error", "Error", "Error"], replies
        assert "malformed" in replies[1].reason and "duplicate" in replies[3].reason
        assert all(isinstance(op, (Challenge, Error, HelloOk)) for op in replies)
    finally:
        transport.close()
    assert receiver.protocol_errors >= 4
    run_transfer(sender, receiver, "still-serving", [3, 4], [5, 6])
    assert_blocks_equal(src, dst, geometry, [3, 4], [5, 6])


def test_an_op_before_the_handshake_closes_that_connection(loopback_pair, geometry):
    from kvtransfer.protocol import Open

    sender, receiver, src, dst = loopback_pair()
    replies: list = []
    transport, link = _raw_link(receiver._transport.network, receiver, replies)
    try:
        transport.reactor.run_sync(link.send_ctrl, encode_ops([Open(1, "x", [1])]))
        deadline = time.monotonic() + 5
        while link.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not link.alive
        assert receiver.protocol_errors == 1
    finally:
        transport.close()
    run_transfer(sender, receiver, "after", [3], [5])
    assert_blocks_equal(src, dst, geometry, [3], [5])


def test_a_wrong_cluster_secret_is_refused_and_closed(geometry):
    from kvtransfer import LoopbackNetwork, create_receiver, create_sender
    from kvtransfer.errors import HandshakeError
    from kvtransfer.protocol import Refuse

    net = LoopbackNetwork()
    src = random_pool(8, geometry, seed=3)
    dst = np.zeros_like(src)
    receiver = create_receiver("loopback", dst, geometry, network=net, secret=b"s" * 32)
    wrong = create_sender("loopback", src, geometry, network=net, secret=b"x" * 32)
    none = create_sender("loopback", src, geometry, network=net)
    right = create_sender("loopback", src, geometry, network=net, secret=b"s" * 32)
    try:
        for bad in (wrong, none):
            with pytest.raises(HandshakeError, match="authentication failed"):
                bad.connect(receiver.address, timeout_s=5)
        assert receiver.auth_failures == 2
        replies: list = []
        transport, link = _raw_link(net, receiver, replies)
        try:  # a raw peer gets nothing but the challenge and the refusal, then is closed
            hello = _hello(replies, geometry, b"x" * 32)
            transport.reactor.run_sync(link.send_ctrl, encode_ops([hello]))
            deadline = time.monotonic() + 5
            while link.alive and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not link.alive
            assert [type(op) for op in replies[1:]] == [Refuse] and replies[1].geometry is None
        finally:
            transport.close()
        run_transfer(right, receiver, "member", [1, 2], [3, 4])
        assert_blocks_equal(src, dst, geometry, [1, 2], [3, 4])
    finally:
        for e in (wrong, none, right, receiver):
            e.close()


def test_silent_peers_are_dropped_and_the_connection_cap_holds(geometry):
    from kvtransfer import LoopbackNetwork, create_receiver, create_sender

    net = LoopbackNetwork()
    src = random_pool(4, geometry, seed=3)
    dst = np.zeros_like(src)
    receiver = create_receiver(
        "loopback", dst, geometry, network=net, hello_timeout_s=0.5, max_connections=2
    )
    raws = [_raw_link(net, receiver, []) for _ in range(3)]
    try:
        deadline = time.monotonic() + 2
        while raws[2][1].alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not raws[2][1].alive  # over the cap: closed at accept
        assert raws[0][1].alive and raws[1][1].alive  # within the hello timeout
        deadline = time.monotonic() + 3
        while any(link.alive for _, link in raws) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(link.alive for _, link in raws)  # never sent hello: dropped
        assert receiver.dropped_connections == 3 and receiver.num_connections == 0
    finally:
        for t, _ in raws:
            t.close()
    sender = create_sender("loopback", src, geometry, network=net)
    try:
        run_transfer(sender, receiver, "after", [1], [2])
        assert_blocks_equal(src, dst, geometry, [1], [2])
    finally:
        sender.close()
        receiver.close()


def test_a_connection_dropped_for_no_hello_leaves_the_table_at_once(geometry):
    """The receiver counted a link it dropped (no hello in time) in ``num_connections`` and
    against ``max_connections`` until the transport's close callback ran on a later turn of its
    reactor, while the peer already saw the link closed: a new sender in that window was
    refused at the cap, and the test above failed once in CI (``dropped_connections == 3``,
    ``num_connections == 2``). The drop and the table change now happen in one step."""
    from kvtransfer import LoopbackNetwork, create_receiver

    net = LoopbackNetwork()
    dst = np.zeros_like(random_pool(4, geometry, seed=3))
    receiver = create_receiver(
        "loopback", dst, geometry, network=net, hello_timeout_s=60, max_connections=1
    )
    raws = [_raw_link(net, receiver, [])]
    try:
        deadline = time.monotonic() + 5
        while receiver.num_connections < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        (il,) = receiver._links.values()

        def time_out_and_count() -> tuple[int, int]:
            receiver._on_hello_timeout(il)  # the timer firing, on the reactor thread
            return receiver.dropped_connections, receiver.num_connections

        assert receiver._reactor.run_sync(time_out_and_count) == (1, 0)
        raws.append(_raw_link(net, receiver, []))  # the cap has room for it at once
        deadline = time.monotonic() + 5
        while receiver.num_connections < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.num_connections == 1 and raws[1][1].alive
        assert receiver.dropped_connections == 1
    finally:
        for t, _ in raws:
            t.close()
        receiver.close()


def test_malformed_messages_to_sender_are_rejected_and_connection_survives(loopback_pair, geometry):
    from kvtransfer.protocol import Done, Error

    sender, receiver, src, dst = loopback_pair()
    run_transfer(sender, receiver, "first", [1], [1])
    (inlink,) = receiver._links.values()
    replies: list = []
    original = inlink.link.on_ctrl

    def capture(payload):
        ops = decode_ops(payload)
        replies.extend(op for op in ops if isinstance(op, Error))
        original(payload)

    inlink.link.on_ctrl = capture
    receiver._reactor.run_sync(inlink.link.send_ctrl, b"\xff\xff")
    receiver._reactor.run_sync(
        inlink.link.send_ctrl, encode_ops([Done(12345)])
    )  # finished/unknown: ignored
    receiver._reactor.run_sync(
        inlink.link.send_ctrl, encode_ops([Data(1, 0, 1, None)])
    )  # wrong direction
    deadline = time.monotonic() + 5
    while len(replies) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (
        len(replies) == 2
        and "malformed" in replies[0].reason
        and "unexpected data" in replies[1].reason
    )
    assert sender.protocol_errors == 2
    run_transfer(sender, receiver, "second", [2, 3], [2, 3])
    assert sender.connections_opened == 1
    assert_blocks_equal(src, dst, geometry, [1, 2, 3], [1, 2, 3])


def test_close_fails_pending_transfers_in_bounded_time(loopback_pair):
    sender, receiver, _, _ = loopback_pair()
    rh = receiver.expect("open1", [1, 2], 30)
    sh = sender.open("open1", receiver.address, [1, 2], 30)
    sh.send_blocks([0], 0)
    time.sleep(0.05)
    t = time.monotonic()
    sender.close()
    assert sh.state is FAILED and isinstance(sh.error, TransportClosedError)
    assert rh.wait(5) == FAILED
    receiver.close()
    assert time.monotonic() - t < 3
    with pytest.raises(TransportClosedError):
        sender.open("again", receiver.address, [1], 1)
    with pytest.raises(TransportClosedError):
        receiver.expect("again", [1], 1)


def test_handles_are_awaitable(loopback_pair):
    sender, receiver, _, _ = loopback_pair()

    async def main():
        rh = receiver.expect("aw", [1], 5)
        sh = sender.open("aw", receiver.address, [1], 5)
        sh.send_blocks([0], 0)
        sh.finish()
        return await asyncio.wait_for(asyncio.gather(rh, sh), 5)

    assert asyncio.run(main()) == [DONE, DONE]


def test_an_abandoned_await_leaves_the_handle_alone(loopback_pair):
    """A wait that gives up (``wait_for``'s timeout, a cancelled task) must not cancel the
    handle's own future: the transfer still settles, and a later await sees its state. (It did
    cancel it: the reactor's settle then raised InvalidStateError and every later await of the
    handle raised CancelledError.)"""
    sender, receiver, _, _ = loopback_pair()

    async def main():
        rh = receiver.expect("gave-up", [1, 2], 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rh, 0.01)  # nothing was sent yet
        sh = sender.open("gave-up", receiver.address, [1, 2], 5)
        sh.send_blocks([0, 1], 0)
        sh.finish()
        return await asyncio.wait_for(asyncio.gather(rh, sh), 5)

    assert asyncio.run(main()) == [DONE, DONE]


def test_the_receivers_handle_is_done_before_its_done_goes_out(loopback_pair, monkeypatch):
    """Whatever the sender does once it reads ``done`` (a prefill worker's reply to the decode
    worker's call) must find the receiver's handle DONE. It was settled just after ``done``
    was sent, so on a loaded host the reply could overtake it (CI saw a NIXL transfer's first
    token taken from the reply instead of the note)."""
    from kvtransfer.protocol import Done
    from kvtransfer.receiver import Receiver

    sender, receiver, _, _ = loopback_pair()
    rh = receiver.expect("ordered", [1, 2], 5)
    seen: list[bool] = []
    send = Receiver._send

    def spy(self, il, *ops):
        if any(isinstance(op, Done) for op in ops):
            seen.append(rh.done)
        send(self, il, *ops)

    monkeypatch.setattr(Receiver, "_send", spy)
    sh = sender.open("ordered", receiver.address, [1, 2], 5)
    sh.send_blocks([3, 4], 0)
    sh.finish(b"note")
    assert sh.wait(5) == DONE and rh.wait(5) == DONE
    assert seen == [True]


def test_the_fin_note_reaches_the_receiver_with_the_blocks(loopback_pair, geometry):
    """``finish(note)``: the receiver's handle holds the bytes once DONE; without one, empty;
    a note too large or not bytes is refused on the caller's thread."""
    from kvtransfer.protocol import MAX_FIN_NOTE_BYTES

    sender, receiver, src, dst = loopback_pair()
    rh = receiver.expect("noted", [3, 4, 5], 5)
    sh = sender.open("noted", receiver.address, [3, 4, 5], 5)
    sh.send_blocks([7, 8, 9], 0)
    with pytest.raises(ValueError):
        sh.finish(b"x" * (MAX_FIN_NOTE_BYTES + 1))
    with pytest.raises(ValueError):
        sh.finish("text")  # type: ignore[arg-type]
    sh.finish(b"first token: 42")
    assert rh.wait(5) == DONE and sh.wait(5) == DONE
    assert rh.note == b"first token: 42"
    assert_blocks_equal(src, dst, geometry, [7, 8, 9], [3, 4, 5])
    _, plain = run_transfer(sender, receiver, "plain", [1], [6])
    assert plain.note == b""


def test_connect_to_nothing_fails_fast(geometry):
    net = LoopbackNetwork()
    sender = create_sender(
        "loopback", np.zeros(geometry.block_bytes, np.uint8), geometry, network=net
    )
    receiver = create_receiver(
        "loopback", np.zeros(geometry.block_bytes, np.uint8), geometry, network=net
    )
    address = receiver.address
    receiver.close()
    try:
        with pytest.raises(PeerLostError, match="connection refused"):
            sender.connect(address, timeout_s=5)
    finally:
        sender.close()


def test_a_peer_not_yet_authenticated_cannot_send_large_control_frames(geometry):
    """Before its hello is accepted a peer may send control frames of at most
    PRE_AUTH_CTRL_BYTES (1 MiB; they were 16 MiB, buffered on each of up to max_connections
    connections by anyone who reaches the port); an accepted sender's limit is 16 MiB again."""
    from kvtransfer import LoopbackNetwork, create_receiver, create_sender
    from kvtransfer.protocol import MAX_CTRL_BYTES, PRE_AUTH_CTRL_BYTES

    net = LoopbackNetwork()
    src = random_pool(4, geometry, seed=3)
    dst = np.zeros_like(src)
    receiver = create_receiver("loopback", dst, geometry, network=net, hello_timeout_s=60)
    replies: list = []
    transport, link = _raw_link(net, receiver, replies)
    try:
        _wait_for(replies, 1)  # the challenge: the receiver has set the link up
        transport.reactor.run_sync(lambda: link.send_ctrl(b"\x00" * (PRE_AUTH_CTRL_BYTES + 1)))
        deadline = time.monotonic() + 5
        while link.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not link.alive
    finally:
        transport.close()
    sender = create_sender("loopback", src, geometry, network=net)
    try:
        run_transfer(sender, receiver, "after", [1], [2])  # a real sender is unaffected
        (il,) = receiver._links.values()
        assert il.link.max_ctrl_bytes == MAX_CTRL_BYTES
        assert_blocks_equal(src, dst, geometry, [1], [2])
    finally:
        sender.close()
        receiver.close()


def test_a_slow_checksum_past_the_settle_bound_does_not_break_the_connection(monkeypatch):
    """A cancelled transfer whose only outstanding work is a checksum job (a local
    computation that ends by itself) waits for it. Before, the settle timeout "broke the peer"
    with 0 operations outstanding, which failed every other transfer on that connection."""
    from kvtransfer import pool as poolmod

    real = poolmod.PoolView.checksums
    slow, hashing, release = threading.Event(), threading.Event(), threading.Event()

    def checksums(self, region):
        if slow.is_set():
            hashing.set()
            release.wait(10)
        return real(self, region)

    monkeypatch.setattr(poolmod.PoolView, "checksums", checksums)
    g = small_geometry()
    net = LoopbackNetwork()
    src = random_pool(64, g, 1)
    dst = np.zeros(64 * g.block_bytes, np.uint8)
    receiver = create_receiver("loopback", dst, g, network=net)
    sender = create_sender(
        "loopback", src, g, network=net, settle_timeout_s=0.2, inline_checksum_bytes=0
    )
    try:
        rb = receiver.expect("B", list(range(32, 40)), 20)
        sb = sender.open("B", receiver.address, list(range(32, 40)), 20)
        sb.send_blocks(list(range(4)), 0)  # B runs on the same connection, unfinished
        deadline = time.monotonic() + 10
        while rb.blocks_done < 4:
            assert time.monotonic() < deadline, rb
            time.sleep(0.005)
        receiver.expect("A", list(range(8)), 20)
        sa = sender.open("A", receiver.address, list(range(8)), 20)
        slow.set()
        sa.send_blocks(list(range(8, 16)), 0)
        sa.finish()
        assert hashing.wait(10)  # A's checksum job runs (and holds its blocks)
        slow.clear()
        sa.cancel()
        time.sleep(0.6)  # three settle bounds: the timer fired while the job still ran
        assert not sa.done and not sb.done, (sa, sb.error)
        release.set()
        assert sa.wait(10) is TransferState.CANCELLED
        sb.send_blocks(list(range(4, 8)), 4)
        sb.finish()
        assert sb.wait(10) is TransferState.DONE, sb.error
        assert rb.wait(10) is TransferState.DONE, rb.error
    finally:
        release.set()
        sender.close()
        receiver.close()

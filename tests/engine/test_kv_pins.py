"""A block handed to a KV transfer is neither freed nor reused until the transfer is terminal.

The two races found in review, pinned here at the engine (fake runner, exact block ids):

* P: preemption freed blocks already handed to the UCX sender, which then read (and
  checksummed) whatever another request wrote there.
* D: an abort during the step that admitted a remote prefill freed the reserved blocks while
  the decode service still posted receives into them.

Both tests failed before the pins existed (the other request's table held the transfer's block).
"""

from __future__ import annotations

import pytest

from shared.engine.connector import RemoteDecodeParams, RemotePrefillParams
from shared.engine.request import RequestStatus
from shared.engine.sampling_params import SamplingParams
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _blocks(engine, rid: str) -> set[int]:
    return set(engine.block_ids_of(rid))


def test_prefill_preemption_never_frees_blocks_handed_to_the_sender(tmp_path):
    # 4 blocks of 16; 16 tokens per request per step. R2 (a long prefill) was admitted before
    # R1 (an exporting prefill-only request), so when R2's next chunk finds no free block the
    # scheduler must preempt one of them and R2 retries its allocation right away. Before the
    # pins it preempted R1 and R2 took R1's exported block; now R1's pinned blocks stay out of
    # reach, and R2 (which holds no pin) is the one preempted.
    e = fake_engine(
        tmp_path,
        num_blocks=4,
        role="prefill",
        block_size=16,
        long_prefill_token_threshold=16,
        max_num_batched_tokens=64,
    )
    e.add_request("r2", list(range(10, 70)), GREEDY)  # 60 tokens: 4 blocks
    e.add_request(
        "r1",
        list(range(20, 60)),
        SamplingParams(temperature=0, max_tokens=1),
        kv_transfer=RemoteDecodeParams(0),
    )  # 40 tokens: 3 blocks
    handed: set[int] = set()
    pins: set[int] = set()
    preempted = r1_done = False
    for _ in range(40):
        for o in e.step():
            if o.kv_blocks_ready:
                handed |= {b for _, b in o.kv_blocks_ready}
                pins.add(o.kv_pin_id)
            r1_done |= o.request_id == "r1" and o.finished
        e.check_integrity()
        preempted |= e.scheduler.num_preemptions > 0
        # while the transfer may still read them, nobody else may hold or reuse them
        assert not (_blocks(e, "r2") & handed), (
            f"r2 holds {sorted(_blocks(e, 'r2') & handed)}, handed to r1's sender"
        )
        for b in handed:
            assert e.kv.pool.blocks[b].ref_cnt >= 1
        if r1_done:
            break
    assert preempted, "the scenario must run out of blocks"
    assert r1_done and len(handed) == 3 and len(pins) == 1
    # the transfer ends: the pin goes, the blocks join the free queue, nothing leaks
    assert e.unpin(pins.pop())
    while e.has_unfinished_requests():
        e.step()
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == 4 and e.kv.num_pinned_blocks == 0


def test_decode_abort_after_admission_keeps_reserved_blocks_until_unpinned(tmp_path):
    e = fake_engine(tmp_path, num_blocks=6, role="decode", block_size=16)
    e.add_request(
        "a", list(range(5, 45)), GREEDY, kv_transfer=RemotePrefillParams()
    )  # 3 blocks reserved
    e.step()  # admits "a" into WAITING_FOR_REMOTE_KV
    (job,) = e.take_remote_prefills()  # the decode service now owns the pin
    reserved = set(job.block_ids)
    assert len(reserved) == 3 and job.pin_id is not None
    # the client cancels right away, before (or while) the receives are posted
    e.abort_request(["a"])
    e.check_integrity()
    # another request must not get a block the prefill worker may still write into
    e.add_request("b", list(range(40, 90)), GREEDY)  # 50 tokens: needs 4 blocks
    for _ in range(6):
        e.step()
        e.check_integrity()
        assert not (_blocks(e, "b") & reserved), "b got a block of a's pending receive"
    assert e.scheduler.requests["b"].status == RequestStatus.WAITING  # no room until unpinned
    # the receive is terminal (cancelled): unpin, and "b" can run
    assert e.unpin(job.pin_id)
    while e.has_unfinished_requests():
        e.step()
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == 6 and e.kv.num_pinned_blocks == 0


def test_abort_before_the_service_took_the_remote_prefill_unpins_it(tmp_path):
    e = fake_engine(tmp_path, num_blocks=6, role="decode", block_size=16)
    e.add_request("a", list(range(5, 45)), GREEDY, kv_transfer=RemotePrefillParams())
    e.step()
    e.abort_request(["a"])  # before take_remote_prefills: no transfer can have started
    assert e.take_remote_prefills() == []
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == 6 and e.kv.num_pinned_blocks == 0


def test_remote_prefill_success_then_unpin_leaves_only_the_table(tmp_path):
    e = fake_engine(tmp_path, num_blocks=8, role="decode", block_size=16)
    e.add_request("a", list(range(5, 45)), GREEDY, kv_transfer=RemotePrefillParams())
    e.step()
    (job,) = e.take_remote_prefills()
    outs = e.finish_remote_prefill("a", None)
    assert outs == []  # None: local prefill of the missing blocks
    assert e.unpin(job.pin_id)
    assert not e.unpin(job.pin_id), "a pin drops once"
    while e.has_unfinished_requests():
        e.step()
        e.check_integrity()
    assert e.kv.pool.num_free_blocks == 8


def test_when_every_candidate_holds_a_pin_the_pinned_blocks_survive_its_preemption(tmp_path):
    # two exporting prefills that cannot both fit: one of them must be preempted; the blocks it
    # handed to its sender stay pinned, so the other never gets them. Each transfer ends (the
    # test unpins) once its request finished, as the prefill service does.
    e = fake_engine(
        tmp_path,
        num_blocks=5,
        role="prefill",
        block_size=16,
        long_prefill_token_threshold=16,
        max_num_batched_tokens=64,
    )
    one = SamplingParams(temperature=0, max_tokens=1)
    e.add_request("p1", list(range(10, 58)), one, kv_transfer=RemoteDecodeParams(0))
    e.add_request("p2", list(range(20, 68)), one, kv_transfer=RemoteDecodeParams(0))
    handed: dict[str, set[int]] = {"p1": set(), "p2": set()}
    pin_of: dict[str, int] = {}
    for _ in range(60):
        for o in e.step():
            if o.kv_blocks_ready:
                handed[o.request_id] |= {b for _, b in o.kv_blocks_ready}
                pin_of[o.request_id] = o.kv_pin_id
            if o.finished:  # its transfer completes right after the prefill
                e.unpin(pin_of.pop(o.request_id, None))
                handed[o.request_id] = set()
        e.check_integrity()
        for me, other in (("p1", "p2"), ("p2", "p1")):
            assert not (_blocks(e, me) & handed[other]), f"{me} holds {other}'s handed blocks"
        if not e.has_unfinished_requests():
            break
    assert not e.has_unfinished_requests() and e.scheduler.num_preemptions >= 1
    e.check_integrity()
    assert e.kv.pool.num_free_blocks == 5 and e.kv.num_pinned_blocks == 0

"""Scheduler: the token budget, chunked prefill, admission order, preemption victims (recompute
and swap), prefix hits at admission, n > 1 forks, the plain-data output, and the connectors."""

from __future__ import annotations

import pytest

from shared.engine.connector import (
    DecodeConnector,
    PrefillConnector,
    RemoteDecodeParams,
    RemotePrefillParams,
)
from shared.engine.request import RequestStatus
from shared.engine.scheduler_output import SampledToken
from tests.unit.factories import BLOCK, make_request, make_scheduler, new_tokens, step

pytestmark = pytest.mark.unit


def test_the_budget_is_split_in_arrival_order_and_prefills_are_chunked():
    s = make_scheduler(budget=10)
    s.add(make_request("a", 7))
    s.add(make_request("b", 7))
    out, _ = step(s)
    assert new_tokens(out) == {"a": 7, "b": 3}  # b's prompt is chunked
    a, b = out.scheduled
    assert a.samples and not b.samples  # only a finished its prompt
    assert (b.start, list(b.token_ids)) == (0, list(s.requests["b"].prompt_token_ids[:3]))
    out, _ = step(s)
    assert new_tokens(out) == {"a": 1, "b": 4}  # a decodes, b finishes its prompt
    assert out.scheduled[1].start == 3 and out.scheduled[1].samples


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add(make_request(rid, 3))
    out, _ = step(s)
    assert list(new_tokens(out)) == ["a", "b"] and s.num_waiting == 1


def test_long_prefill_token_threshold_caps_one_request_per_step():
    s = make_scheduler(budget=64, long_prefill=4)
    s.add(make_request("a", 10))
    assert [new_tokens(step(s)[0])["a"] for _ in range(3)] == [4, 4, 2]


def test_prompt_tokens_while_decoding_are_capped_and_the_rest_follows():
    s = make_scheduler(num_blocks=32, budget=64, max_model_len=128, prefill_while_decoding=8)
    s.add(make_request("a", 5))
    assert new_tokens(step(s)[0]) == {"a": 5}  # nothing decodes yet: the whole budget
    s.add(make_request("b", 12))
    s.add(make_request("c", 6))
    # a decodes: b and c share 8 prompt tokens a step, in arrival order, until both are in
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 8}
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 4, "c": 4}
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 1, "c": 2}
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 1, "c": 1}


def test_a_request_waits_while_the_prompt_room_is_spent_and_a_cached_prompt_does_not():
    s = make_scheduler(num_blocks=32, budget=64, max_model_len=128, prefill_while_decoding=4)
    s.add(make_request("a", 3))
    step(s)
    s.add(make_request("b", 4))
    s.add(make_request("c", 9))
    out, _ = step(s)
    assert new_tokens(out) == {"a": 1, "b": 4} and s.num_waiting == 1  # c: no room left
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 1, "c": 4}
    # a prompt whose every token but the last is cached computes one token: no room needed
    prompt = list(range(40, 40 + 2 * BLOCK + 1))
    s.add(make_request("d", prompt))
    for _ in range(3):
        step(s)
    s.add(make_request("e", list(prompt)))
    s.add(make_request("f", 30))
    out, _ = step(s)
    assert new_tokens(out)["e"] == 1 and new_tokens(out)["f"] == 4


def test_a_chunk_cut_to_one_token_spends_the_last_of_the_room():
    s = make_scheduler(num_blocks=32, budget=64, max_model_len=128, prefill_while_decoding=9)
    s.add(make_request("a", 3))
    step(s)
    for rid, n in (("b", 8), ("c", 6), ("d", 5)):
        s.add(make_request(rid, n))
    out, _ = step(s)
    assert new_tokens(out) == {"a": 1, "b": 8, "c": 1} and s.num_waiting == 1  # d: none left


def test_without_the_cap_a_decoding_step_takes_the_whole_budget():
    s = make_scheduler(num_blocks=32, budget=64, max_model_len=128)
    s.add(make_request("a", 5))
    step(s)
    s.add(make_request("b", 40))
    assert new_tokens(step(s)[0]) == {"a": 1, "b": 40}


def test_the_scheduled_item_is_plain_data_with_the_whole_block_table():
    s = make_scheduler()
    s.add(make_request("a", list(range(100, 106)), max_tokens=3, repetition_penalty=1.5))
    out, _ = step(s)
    (item,) = out.scheduled
    assert (item.seq_id, item.start, list(item.token_ids)) == ("a", 0, list(range(100, 106)))
    assert list(item.block_ids) == [0, 1]
    (spec,) = item.samples
    assert spec.seq_id == "a" and spec.num_output_tokens == 0
    assert tuple(spec.prompt_token_ids) == tuple(range(100, 106))  # for the penalty only
    out, _ = step(s, token=9)
    (item,) = out.scheduled
    assert (item.start, list(item.token_ids)) == (6, [7])
    assert item.samples[0].num_output_tokens == 1 and tuple(item.samples[0].output_token_ids) == (
        7,
    )


def test_recompute_preempts_the_most_recent_request_and_requeues_it_first():
    # 4 blocks of 4: a and b hold 2 each; a's next token needs a fifth block
    s = make_scheduler(num_blocks=4)
    s.add(make_request("a", 8, max_tokens=4))
    s.add(make_request("b", 7, max_tokens=4))
    step(s)
    assert s.kv.block_ids("a") == [0, 1] and s.kv.block_ids("b") == [2, 3]
    out, _ = step(s)  # a: token 9 needs block 3 of its table; b is preempted
    assert out.num_preempted == 1 and new_tokens(out) == {"a": 1}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and s.kv.block_ids("a") == [0, 1, 3]
    assert s.num_preemptions == 1
    s.kv.check_integrity(s.live_request_ids())


def test_swap_preemption_moves_the_victim_to_host_and_back():
    s = make_scheduler(num_blocks=4, mode="swap", host_blocks=4)
    s.add(make_request("a", 8, max_tokens=6))
    s.add(make_request("b", 7, max_tokens=6))
    step(s)
    out, _ = step(s)
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)]  # (device, host), in table order
    b = s.requests["b"]
    assert b.status == RequestStatus.SWAPPED and s.kv.swapped["b"] == [0, 1]
    # a finishes; then b comes back from the host pool with its computed tokens intact
    while "a" in s.requests:
        step(s)
    computed = b.num_computed_tokens
    out, _ = step(s)
    assert len(out.blocks_to_swap_in) == 2 and [h for h, _ in out.blocks_to_swap_in] == [0, 1]
    assert b.status == RequestStatus.RUNNING and out.scheduled[0].start == computed
    s.kv.check_integrity(s.live_request_ids())


def test_admission_starts_after_the_cached_prefix():
    s = make_scheduler()
    s.add(make_request("a", list(range(100, 109)), max_tokens=1))
    step(s)  # a finishes after one token; its two full blocks stay cached
    assert "a" not in s.requests
    s.add(make_request("b", list(range(100, 108)) + [5, 5, 5], max_tokens=1))
    out, _ = step(s)
    (item,) = out.scheduled
    assert item.start == 8 and list(item.token_ids) == [5, 5, 5]
    assert list(item.block_ids[:2]) == [0, 1]
    assert s.requests.get("b") is None or s.requests["b"].num_cached_tokens == 8


@pytest.mark.parametrize("remote", [False, True])
def test_cached_tokens_and_prefix_stats_count_the_admission_not_each_look(remote):
    # b shares c's two cached blocks but waits for room while a grows and evicts them: b is
    # admitted with no hit. Its num_cached_tokens (usage's cached_tokens) was taken at its
    # first look (8), and the hit-rate stats counted each of its 13 looks (vLLM counts the
    # lookup once, at admission).
    conn = DecodeConnector() if remote else None
    s = make_scheduler(num_blocks=8, connector=conn)
    s.add(make_request("c", list(range(100, 109)), max_tokens=1))
    step(s)  # c's two full blocks stay cached
    s.add(make_request("a", 20, max_tokens=12))
    b = make_request("b", list(range(100, 108)) + list(range(300, 309)), max_tokens=1)
    if conn is not None:
        conn.add(b, RemotePrefillParams())
    s.add(b)
    looks = 0
    while b.status == RequestStatus.WAITING:
        out, _ = step(s)
        looks += 1
        assert b.num_cached_tokens < 0 or b.status != RequestStatus.WAITING
    assert looks > 5, "b was meant to wait while a evicted c's blocks"
    assert b.num_cached_tokens == 0
    if conn is not None:
        (job,) = conn.take_jobs()
        assert job.first_block_index == 0 and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    else:
        assert new_tokens(out) == {"b": 17}
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (9 + 20 + 17, 0)


def test_n_samples_fork_at_the_first_token_with_a_copy_of_the_partial_block():
    s = make_scheduler()
    s.add(make_request("p", 6, max_tokens=3, n=3))
    out, updates = step(s)
    (item,) = out.scheduled
    assert [spec.seq_id for spec in item.samples] == ["0_p", "1_p", "2_p"]
    assert s.kv.block_ids("0_p") == [0, 1]
    assert s.kv.block_ids("1_p")[0] == 0 and s.kv.block_ids("2_p")[0] == 0  # shared full block
    assert s.pending_copies == [(1, 2), (1, 3)]  # each sibling's own copy of the partial block
    assert [u.request.request_id for u in updates] == ["0_p", "1_p", "2_p"]
    out, _ = step(s)
    assert out.blocks_to_copy == [(1, 2), (1, 3)] and len(out.scheduled) == 3
    assert all(x.start == 6 for x in out.scheduled)  # each computes its own first token
    s.kv.check_integrity(s.live_request_ids())


def test_a_sampling_failure_is_reported_not_applied():
    s = make_scheduler()
    s.add(make_request("a", 3))
    out = s.schedule()
    from shared.engine.scheduler_output import SampleError

    updates, failures = s.update_from_output(out, {"a": SampleError("boom")})
    assert updates == [] and [f.request.request_id for f in failures] == ["a"]
    assert s.requests["a"].num_computed_tokens == 0  # untouched


# ---- connectors -------------------------------------------------------------------------


def test_decode_connector_reserves_pins_and_parks_the_request():
    conn = DecodeConnector()
    s = make_scheduler(connector=conn)
    r = make_request("a", 10)
    conn.add(r, RemotePrefillParams())
    s.add(r)
    out, _ = step(s)
    assert out.scheduled == [] and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    (job,) = conn.take_jobs()
    assert (job.request_id, job.first_block_index, job.block_ids) == ("a", 0, (0, 1, 2))
    assert [s.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 2]  # table + pin
    assert [s.kv.pool.blocks[i].block_hash for i in (0, 1, 2)] == [None] * 3  # not served yet
    updates = s.finish_remote_prefill("a", [SampledToken(9)])
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 10
    assert updates[0].new_token_ids == [9]
    assert s.kv.pool.blocks[0].block_hash == r.block_hashes[0]  # now hashed
    s.kv.unpin(job.pin_id)
    out, _ = step(s)
    assert new_tokens(out) == {"a": 1} and out.scheduled[0].start == 10
    s.kv.check_integrity(s.live_request_ids())


def test_decode_connector_only_asks_for_what_the_local_cache_lacks():
    conn = DecodeConnector()
    s = make_scheduler(connector=conn)
    s.add(make_request("warm", list(range(100, 109)), max_tokens=1))
    step(s)
    r = make_request("a", list(range(100, 108)) + [1, 2, 3])
    conn.add(r, RemotePrefillParams())
    s.add(r)
    step(s)
    (job,) = conn.take_jobs()
    assert job.first_block_index == 2 and len(job.block_ids) == 1
    assert r.num_computed_tokens == 2 * BLOCK


def test_an_aborted_reservation_not_yet_taken_is_unpinned_by_the_connector():
    conn = DecodeConnector()
    s = make_scheduler(num_blocks=4, connector=conn)
    r = make_request("a", 10)
    conn.add(r, RemotePrefillParams())
    s.add(r)
    step(s)
    s.abort(["a"])
    assert conn.take_jobs() == [] and s.kv.pool.num_free_blocks == 4
    s.kv.check_integrity(s.live_request_ids())


def test_prefill_connector_reports_each_block_once_as_it_completes():
    conn = PrefillConnector()
    s = make_scheduler(connector=conn, long_prefill=4)
    r = make_request("a", 10, max_tokens=1)
    conn.check(RemoteDecodeParams(1), 10, BLOCK)
    conn.add(r, RemoteDecodeParams(1))  # blocks 1 and 2 go to a decode worker
    s.add(r)
    reported = []
    for _ in range(3):
        _, updates = step(s)
        reported.append([x for u in updates for x in u.kv_blocks_ready])
    assert reported == [[], [(1, 1)], [(2, 2)]]  # block 0 is not asked for; 2 is partial
    pins = {u.kv_pin_id for u in updates if u.kv_blocks_ready}
    assert len(pins) == 1 and s.kv.num_pinned_blocks == 2
    assert "a" not in s.requests  # finished: its table is freed, the pinned blocks are not
    assert s.kv.pool.blocks[1].ref_cnt == 1 and s.kv.pool.blocks[0].ref_cnt == 0


def test_the_preemption_victim_is_the_latest_request_without_a_pin():
    conn = PrefillConnector()
    s = make_scheduler(num_blocks=4, connector=conn, long_prefill=4, budget=64)
    s.add(make_request("long", 16, max_tokens=1))
    r = make_request("exp", 12, max_tokens=1)
    conn.add(r, RemoteDecodeParams(0))
    s.add(r)
    step(s)  # long: 1 block, exp: 1 block, reported and pinned
    step(s)  # long: 2, exp: 2; the pool is full
    out, _ = step(s)  # long needs another block: exp holds a pin, so long is preempted
    assert s.requests["long"].status == RequestStatus.PREEMPTED
    assert s.requests["exp"].status == RequestStatus.RUNNING
    assert out.num_preempted == 1


def test_pipeline_micro_batches_skip_sequences_in_flight_and_take_a_share():
    """Pipeline parallelism: a step scheduled while another is in flight leaves that step's
    sequences out (their tokens are not known yet) and takes at most ``max_running``."""
    s = make_scheduler(budget=64)
    for rid in "abcd":
        s.add(make_request(rid, 3))
    step(s)  # every prompt computed: four decoding sequences
    first = s.schedule(max_running=2)
    assert list(new_tokens(first)) == ["a", "b"]
    second = s.schedule(skip={"a", "b"}, max_running=2)
    assert list(new_tokens(second)) == ["c", "d"]
    third = s.schedule(skip={"a", "b", "c", "d"}, max_running=2)
    assert third.is_empty  # everything in flight
    s.update_from_output(first, {"a": SampledToken(7), "b": SampledToken(7)})
    assert list(new_tokens(s.schedule(skip={"c", "d"}, max_running=2))) == ["a", "b"]


def test_finished_ids_wait_for_a_step_that_runs():
    """An empty schedule (everything in flight, or idle) keeps the ids of sequences that ended
    for the next step the runner sees (its sampler drops their grammar state then)."""
    s = make_scheduler(budget=64)
    a = make_request("a", 3, max_tokens=1)
    a.grammar = object()  # a constrained sequence: the sampler holds state for it
    s.add(a)
    s.add(make_request("b", 3))
    out, _ = step(s)  # a finishes on its first token
    empty = s.schedule(skip={"b"})
    assert empty.is_empty and empty.finished_seq_ids == []
    assert "a" in s.schedule().finished_seq_ids

"""``n > 1``: the leader sample finishing on its first token must not take its siblings' prompt
blocks with it (fuzz found a KeyError on the decode worker: the siblings forked the leader's
blocks after its finish had freed them)."""

from __future__ import annotations

from shared.engine import LLM
from shared.engine.connector import RemotePrefillParams
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampledToken
from tests.engine.fakes import fake_engine


def test_siblings_go_on_when_the_leader_stops_on_its_first_token(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", kv_cache_memory="32MiB")
    vocab = llm.engine.model_config.vocab_size
    stops = list(range(3, vocab, 2))  # half the vocabulary stops a sample
    leader_stopped_first = 0
    for seed in range(32):
        sp = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=6, stop_token_ids=stops)
        (out,) = llm.generate([[5, 6, 7, 8, 9]], sp)
        assert len(out.outputs) == 2, out
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length"), (seed, o)
        lead, sib = sorted(out.outputs, key=lambda o: o.index)
        if len(lead.token_ids) == 1 and lead.finish_reason == "stop" and len(sib.token_ids) > 1:
            leader_stopped_first += 1
    assert leader_stopped_first > 0, "no seed had the leader stop first: the case went untested"
    llm.engine.check_integrity()


def test_siblings_go_on_when_a_remote_prefills_leader_stops_on_its_first_token(tmp_path):
    # The decode worker's twin: the prefill worker's first tokens arrive together
    # (``finish_remote_prefill``); the leader's is a stop token, the sibling's is not.
    e = fake_engine(tmp_path, num_blocks=16, role="decode", block_size=16)
    sp = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, stop_token_ids=[11])
    e.add_request("r", list(range(3, 40)), sp, kv_transfer=RemotePrefillParams())
    e.step()  # reserves the prompt's blocks for the transfer
    (job,) = e.take_remote_prefills()
    e.runner.write(list(job.block_ids), 0, list(range(3, 40)))  # the transfer, played
    outs = e.finish_remote_prefill("r", [SampledToken(11), SampledToken(12)])
    assert e.unpin(job.pin_id)
    first = {o.index: o for o in outs}
    assert first[0].new_token_ids == [11] and first[0].finish_reason == "stop"
    assert first[1].new_token_ids == [12] and first[1].finish_reason is None
    tokens = [12]
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.index == 1
            tokens += o.new_token_ids
        e.check_integrity()
    assert len(tokens) == 4 and tokens[0] == 12
    assert e.kv.pool.num_free_blocks == 16 and e.kv.num_pinned_blocks == 0


def _samples(e, rid="r", abort_first=False, remote=False):
    kw = {"kv_transfer": RemotePrefillParams()} if remote else {}
    sp = SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=1)
    e.add_request(rid, [5, 6, 7, 8, 9], sp, **kw)
    if remote:
        e.step()  # reserves the blocks; the transfer never comes
    got: dict[int, list[int]] = {}
    if abort_first:
        (out,) = e.abort_samples(rid, [0])
        assert out.index == 0 and out.finish_reason == "abort"
    for _ in range(40):
        if not e.has_unfinished_requests():
            break
        for o in e.step():
            got.setdefault(o.index, []).extend(o.new_token_ids)
        e.check_integrity()
    assert not e.has_unfinished_requests()
    assert rid not in e.parents and not e.scheduler.live_request_ids()
    return got


def test_the_other_samples_go_on_when_the_first_is_aborted_before_its_first_token(tmp_path):
    # Pending siblings fork at the leader's first token; aborting the leader before it left
    # them unscheduled forever, and the request id could not be used again (found by review)
    want = _samples(fake_engine(tmp_path / "a", num_blocks=16, block_size=4))
    e = fake_engine(tmp_path / "b", num_blocks=16, block_size=4)
    got = _samples(e, abort_first=True)
    assert got == {1: want[1], 2: want[2]}
    _samples(e)  # the id again
    assert e.kv.pool.num_free_blocks == 16


def test_a_remote_prefills_other_samples_go_on_locally_when_the_first_is_aborted(tmp_path):
    want = _samples(fake_engine(tmp_path / "a", num_blocks=16, block_size=4))
    e = fake_engine(tmp_path / "b", num_blocks=16, role="decode", block_size=4)
    got = _samples(e, abort_first=True, remote=True)
    assert got == {1: want[1], 2: want[2]}
    assert e.kv.pool.num_free_blocks == 16 and e.kv.num_pinned_blocks == 0


def test_siblings_wait_for_a_slot_under_max_num_seqs(tmp_path):
    """The siblings of an ``n > 1`` request forked into the running batch at the leader's first
    token whatever ``--max-num-seqs`` said: ``n=4`` under a cap of 2 ran 4 sequences a step
    (past the largest batch a GPU's memory profile and captured graphs were sized for). Those
    over the cap now wait, and resume from the prefix cache with the same tokens."""

    def run(cap: int):
        e = fake_engine(tmp_path / str(cap), num_blocks=32, block_size=4, max_num_seqs=cap)
        sp = SamplingParams(n=4, max_tokens=6, ignore_eos=True, seed=3, temperature=1.0)
        e.add_request("r", [5, 6, 7, 8, 9, 10], sp)
        got: dict[int, list[int]] = {}
        for _ in range(60):
            if not e.has_unfinished_requests():
                break
            for o in e.step():
                got.setdefault(o.index, []).extend(o.new_token_ids)
            e.check_integrity()
            assert e.scheduler.num_running <= cap
        assert not e.has_unfinished_requests()
        widest = max(len(s.scheduled) for s in e.runner.steps)
        return got, widest

    free, widest_free = run(8)
    capped, widest_capped = run(2)
    assert widest_free == 4 and widest_capped == 2
    assert capped == free and all(len(t) == 6 for t in free.values())

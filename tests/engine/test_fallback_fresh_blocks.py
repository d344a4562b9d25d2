"""A decode worker whose cancelled KV receive does not stop in time prefills the request on new
blocks (``EngineCore.finish_remote_prefill(..., fresh_blocks=True)``): the blocks reserved for
the transfer stay with its pin, and whatever the late receive writes into them never reaches
the request. Before, such a request failed with an error to its client although nothing was
wrong with it (the decode service had no way to prefill it but into the reserved blocks)."""

from __future__ import annotations

import pytest

from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.connector import DecodeConnector, RemotePrefillParams
from shared.engine.sampling_params import SamplingParams
from tests.engine.helpers import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PREFIX = list(range(5, 37))  # two whole blocks of 16, cached by a first request
PROMPT = PREFIX + list(range(100, 140))  # 72 tokens: two cached blocks, three reserved


def _engine(model, num_blocks: int = 64, max_model_len: int = 256) -> EngineCore:
    e = EngineCore(
        EngineArgs(
            model=str(model),
            device="cpu",
            num_gpu_blocks_override=num_blocks,
            max_model_len=max_model_len,
        ),
        connector=DecodeConnector(),
    )
    e.add_request("warm", PREFIX + [40, 41], SamplingParams(temperature=0, max_tokens=1))
    while e.has_unfinished_requests():
        e.step()
    return e


def _run(model, fresh: bool) -> list[int]:
    e = _engine(model)
    queries = e.kv.prefix_queries
    e.add_request("r", PROMPT, GREEDY.clone(), kv_transfer=RemotePrefillParams())
    e.step()  # admits "r": its cached prefix, three blocks reserved (and pinned) for P
    (job,) = e.take_remote_prefills()
    assert job.first_block_index == 2 and len(job.block_ids) == 3
    reserved = set(job.block_ids)
    prefix_blocks = e.block_ids_of("r")[:2]
    # P failed and the receive into the reserved blocks did not stop: a local prefill
    assert e.finish_remote_prefill("r", None, fresh_blocks=fresh) == []
    tokens: list[int] = []
    kv = e.runner.kv_cache
    while e.has_unfinished_requests():
        for b in reserved:  # the late receive keeps landing, step after step
            kv[b].fill_(float("nan"))
        for o in e.step():
            tokens += o.new_token_ids
        e.check_integrity()
        if fresh and e.block_ids_of("r"):
            # admitted afresh: its cached prefix again, new blocks for the rest
            assert e.block_ids_of("r")[:2] == prefix_blocks
            assert not set(e.block_ids_of("r")) & reserved
            assert all(e.kv.pool.blocks[b].ref_cnt >= 1 for b in reserved), "pin dropped early"
    assert e.unpin(job.pin_id)  # the receive ends at last
    e.check_integrity()
    assert e.kv.num_pinned_blocks == 0
    # its prefix lookup counts once, at its first admission (the re-admission's would count
    # the prompt twice)
    assert e.kv.prefix_queries - queries == len(PROMPT)
    return tokens


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh_blocks", "reserved_blocks"])
def test_late_writes_into_the_reserved_blocks_never_reach_a_fresh_block_prefill(tiny_llama, fresh):
    want = hf_greedy(tiny_llama, [PROMPT], MAX_NEW)[0]
    tokens = _run(tiny_llama, fresh)
    if fresh:
        assert tokens == want
    else:
        # the scenario's late writes are real: into the blocks the prefill used, they corrupt
        assert tokens != want


def test_a_prompt_that_cannot_fit_beside_the_pinned_blocks_fails_instead_of_stalling(tiny_llama):
    """Seven blocks, three of them pinned by the transfer: the 72-token prompt needs five
    anew. Queued, it would wait at the head of the queue (or preempt itself chunk after
    chunk) until the receive ended; it fails at once, and the others go on."""
    e = _engine(tiny_llama, num_blocks=7, max_model_len=96)
    e.add_request("r", PROMPT, GREEDY.clone(), kv_transfer=RemotePrefillParams())
    e.step()
    (job,) = e.take_remote_prefills()
    (out,) = e.finish_remote_prefill("r", None, fresh_blocks=True)
    assert out.finish_reason == "error" and out.failure is not None
    assert "does not fit" in out.failure.message
    e.add_request("next", [7, 8, 9], GREEDY.clone())
    got = []
    while e.has_unfinished_requests():
        got += [t for o in e.step() for t in o.new_token_ids]
        e.check_integrity()
    assert len(got) == MAX_NEW
    assert all(e.kv.pool.blocks[b].ref_cnt >= 1 for b in job.block_ids)  # still pinned
    assert e.unpin(job.pin_id)
    e.check_integrity()
    assert e.kv.num_pinned_blocks == 0

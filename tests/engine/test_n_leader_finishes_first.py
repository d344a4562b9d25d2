"""``n > 1``: the leader sample finishing on its first token must not take its siblings' prompt
blocks with it (fuzz found a KeyError on the decode worker: the siblings forked the leader's
blocks after its finish had freed them)."""

from __future__ import annotations

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams


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

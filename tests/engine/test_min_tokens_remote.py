"""``min_tokens`` holds on the disaggregated path from the first token on: the prefill worker
draws that token under the same ban on EOS and the stop ids as a colocated engine would. It
used to draw it with ``min_tokens`` 0, and the decode worker then ended the request on an EOS
after one token (found by review, 2026-12-06)."""

from __future__ import annotations

from prefill_service.server import first_token_only
from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.connector import DecodeConnector, RemotePrefillParams
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampledToken


def _engine(model, connector=None) -> EngineCore:
    args = EngineArgs(model=str(model), device="cpu", num_gpu_blocks_override=64, max_model_len=256)
    return EngineCore(args, connector=connector)


def _drain(e: EngineCore, outs=None) -> tuple[list[int], str | None]:
    outs = list(outs or [])
    while e.has_unfinished_requests():
        outs += e.step()
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


def test_first_token_only_keeps_a_ban_on_the_first_token():
    for want, got in ((0, 0), (1, 1), (3, 1)):
        p = SamplingParams(max_tokens=8, min_tokens=want)
        first_token_only(p)
        assert (p.max_tokens, p.min_tokens) == (1, got)


def test_min_tokens_through_a_prefill_worker_matches_colocated(tiny_llama):
    colo = _engine(tiny_llama)
    eos = colo.model_config.eos_token_ids[0]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    # EOS all but certain at every step: only min_tokens keeps the request going
    client = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, logit_bias={eos: 50.0})
    colo.add_request("c", prompt, client.clone())
    want, want_finish = _drain(colo)
    assert len(want) == 4 and want[-1] == eos and want_finish == "stop", want

    p_params = client.clone()
    first_token_only(p_params)
    pe = _engine(tiny_llama)
    pe.add_request("r", prompt, p_params)
    first, _ = _drain(pe)
    assert first == want[:1]

    de = _engine(tiny_llama, DecodeConnector())
    de.add_request("r", prompt, client.clone(), kv_transfer=RemotePrefillParams())
    de.step()
    (job,) = de.take_remote_prefills()
    outs = de.finish_remote_prefill("r", [SampledToken(first[0])])
    de.unpin(job.pin_id)
    got, finish = _drain(de, outs)
    # the KV was not moved here, so the middle tokens may differ; the length may not
    assert got[0] == want[0] and len(got) == len(want) == 4, (got, want)
    assert got[-1] == eos and eos not in got[:-1] and finish == "stop"


def test_min_tokens_bans_eos_under_ignore_eos_through_a_prefill_worker(tiny_llama):
    """With ignore_eos the first min_tokens tokens are no EOS either (vLLM), on both paths: the
    prefill worker draws the first token under the ban, the decode worker the rest; after
    min_tokens, EOS tokens follow (ignore_eos) until max_tokens."""
    colo = _engine(tiny_llama)
    eos = colo.model_config.eos_token_ids[0]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    client = SamplingParams(
        temperature=0.0, min_tokens=3, max_tokens=6, ignore_eos=True, logit_bias={eos: 50.0}
    )
    colo.add_request("c", prompt, client.clone())
    want, want_finish = _drain(colo)
    assert eos not in want[:3] and want[3:] == [eos] * 3 and want_finish == "length", want

    p_params = client.clone()
    first_token_only(p_params)
    pe = _engine(tiny_llama)
    pe.add_request("r", prompt, p_params)
    first, _ = _drain(pe)
    assert first == want[:1]

    de = _engine(tiny_llama, DecodeConnector())
    de.add_request("r", prompt, client.clone(), kv_transfer=RemotePrefillParams())
    de.step()
    (job,) = de.take_remote_prefills()
    outs = de.finish_remote_prefill("r", [SampledToken(first[0])])
    de.unpin(job.pin_id)
    got, finish = _drain(de, outs)
    assert got[0] == want[0] and eos not in got[:3], (got, want)
    assert got[3:] == [eos] * 3 and finish == "length"

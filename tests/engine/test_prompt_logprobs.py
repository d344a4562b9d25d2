"""vLLM's ``prompt_logprobs``: the logprob, rank and top-N of every prompt token after the
first, from the raw model's distribution at the position before it. Checked against
``transformers`` in fp32 on every path that computes a prompt (one step, chunked, preempted
and recomputed, with the prompt already in the prefix cache), and against the fake runner's
positions for chunking, preemption and ``n > 1``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine import LLM, InvalidRequestError
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SchedulerOutput
from tests.engine.fakes import fake_engine
from tests.engine.helpers import _hf_model, random_prompts

TOP = 3


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """log-softmax of the raw fp32 logits at every position of ``prompt``."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(model_dir, prompt: list[int], got) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for p in range(1, len(prompt)):
        lp, row, tok = got[p], ref[p - 1], prompt[p]
        assert abs(lp.logprob - float(row[tok])) < 1e-4, (p, lp.logprob, float(row[tok]))
        # the rank among tokens whose logprobs differ from this one's by more than the
        # tolerance is exact; one within it may fall on either side (fp32 sums in another
        # order: on an Intel AMX host a token at rank 1,070 came out 1,069, a near-tie)
        above = int((row > row[tok] + 1e-4).sum()) + 1
        near = int((row > row[tok] - 1e-4).sum())  # (it counts this token too)
        assert above <= lp.rank <= near, (p, lp.rank, above, near)
        vals, ids = row.topk(TOP)
        assert [t for t, _ in lp.top] == ids.tolist(), p
        assert all(abs(v - float(w)) < 1e-4 for (_, v), w in zip(lp.top, vals))


CONFIGS = {
    "default": {},
    "chunked_budget_64": dict(max_num_batched_tokens=64, max_num_seqs=8),
    "preempt_recompute": dict(
        num_gpu_blocks_override=40, max_model_len=600, max_num_seqs=8, max_num_batched_tokens=64
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_match_transformers(tiny_llama, name):
    prompts = random_prompts(21, lengths=[1, 2, 17, 130, 300, 300, 280, 290])
    llm = LLM(str(tiny_llama), **CONFIGS[name])
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if name == "preempt_recompute":
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    for p, o in zip(prompts, outs):
        check_against_hf(tiny_llama, p, o.prompt_logprobs)
        assert o.num_cached_tokens == 0
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks, "blocks leaked"


def test_a_cached_prompt_is_computed_again_and_only_for_them(tiny_llama):
    llm = LLM(str(tiny_llama))
    prompt = random_prompts(22, lengths=[200])[0]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    assert first.prompt_logprobs is None
    with_lp = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP, n=2),
    )[0]
    assert with_lp.num_cached_tokens == 0  # the cache was not read for it
    check_against_hf(tiny_llama, prompt, with_lp.prompt_logprobs)
    assert [c.token_ids for c in with_lp.outputs] == [first.outputs[0].token_ids] * 2
    again = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    assert again.num_cached_tokens >= 192  # requests without them still hit the cache
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.check_integrity()  # the recomputed copies of cached blocks were accounted for
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks, "blocks leaked"


def _run(engine) -> dict:
    """Step until idle; the prompt logprobs of each request, and how often they came."""
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in got, "prompt logprobs sent twice"
                got[o.request_id] = o.prompt_logprobs
    return got


def test_chunks_preemption_and_siblings_give_each_position_once(tmp_path):
    # 10 blocks of 8: "a" (47 tokens) decodes and grows while "b" is prefilled 7 tokens a
    # step beside it, until a's growth preempts b mid-prefill (b is computed again later)
    e = fake_engine(tmp_path, num_blocks=10, max_num_batched_tokens=8, block_size=8)
    steps: list[SchedulerOutput] = e.runner.steps  # type: ignore[attr-defined]
    prompts = {"a": list(range(10, 57)), "b": list(range(50, 90)), "one": [7]}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=0)
    e.add_request("a", prompts["a"], params)
    got: dict[str, list] = {}
    while "a" not in got:
        for o in e.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    e.add_request("b", prompts["b"], dataclasses.replace(params, n=2))
    e.add_request("one", prompts["one"], params)
    got.update(_run(e))
    assert set(got) == {"a", "b", "one"}
    for rid, prompt in prompts.items():
        # the fake's logprob of the target at prompt position p is -p; its rank token % 7 + 1
        assert [lp.logprob for lp in got[rid]] == [-float(p) for p in range(1, len(prompt))]
        assert [lp.rank for lp in got[rid]] == [t % 7 + 1 for t in prompt[1:]]
    chunked = [s for out in steps for s in out.scheduled if s.prompt_logprob_targets]
    assert any(len(s.token_ids) < 40 for s in chunked), "the prompts were meant to be chunked"
    starts = [s.seq_id for s in chunked if s.start == 0]
    assert len(starts) > len(set(starts)), "a prompt was meant to be preempted mid-prefill"
    e.check_integrity()


def test_prompt_logprobs_are_checked_against_max_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    p = SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs.*--max-logprobs"):
        p.validate(20)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_top_n_above_the_vocabulary_is_refused_by_name(tmp_path, name):
    # --max-logprobs above the vocabulary: a top-N of vocab + 1 passed validate(), and for
    # prompt_logprobs the runner's topk raised inside step(), which stopped the engine
    e = fake_engine(tmp_path, vocab=97, max_logprobs=4096)
    with pytest.raises(InvalidRequestError, match=f"{name} 98 exceeds the vocabulary") as err:
        e.add_request("big", [5, 6, 7], SamplingParams(max_tokens=2, **{name: 98}))
    assert err.value.param == name
    assert not e.has_unfinished_requests()
    e.add_request("all", [5, 6, 7], SamplingParams(max_tokens=2, **{name: 97}))  # the whole vocab
    while e.has_unfinished_requests():
        e.step()
    e.check_integrity()

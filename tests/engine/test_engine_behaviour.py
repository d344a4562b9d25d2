"""Engine behaviour: randomized integrity, n > 1 sharing, seeded determinism, bad input."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from shared.config import ConfigError, EngineArgs
from shared.engine import LLM, EngineCore, InvalidRequestError, PromptTooLongError
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.models.loader import ModelLoadError
from tests.engine.helpers import hf_greedy, random_prompts


def _drain(engine: EngineCore, max_steps: int = 5000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs += engine.step()
        engine.check_integrity()
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_randomized_steps_keep_integrity(tiny_llama, mode):
    rng = random.Random(7 if mode == "recompute" else 8)
    engine = EngineCore(
        EngineArgs(
            model=str(tiny_llama),
            num_gpu_blocks_override=48,
            max_model_len=400,
            max_num_batched_tokens=96,
            max_num_seqs=8,
            preemption_mode=mode,
            swap_space=0.002,
        )
    )
    prefixes = [[rng.randrange(3, 2048) for _ in range(rng.choice([16, 40, 64]))] for _ in range(3)]
    live: dict[str, SamplingParams] = {}
    produced: dict[tuple[str, int], int] = {}
    finished: set[str] = set()
    next_id = 0
    for _step in range(400):
        if rng.random() < 0.35:
            n_prompt = rng.randint(1, 250)
            prompt = [rng.randrange(3, 2048) for _ in range(n_prompt)]
            if rng.random() < 0.5:
                prompt = rng.choice(prefixes) + prompt[:60]
            params = SamplingParams(
                n=rng.choice([1, 1, 1, 2, 3]),
                max_tokens=rng.randint(1, 40),
                temperature=rng.choice([0.0, 0.7, 1.0]),
                seed=rng.choice([None, 5]),
                top_k=rng.choice([0, 20]),
                top_p=rng.choice([1.0, 0.9]),
                ignore_eos=True,
            )
            rid = f"r{next_id}"
            next_id += 1
            engine.add_request(rid, prompt, params)
            live[rid] = params
        if live and rng.random() < 0.06:
            victim = rng.choice(sorted(live))
            for o in engine.abort_request([victim]):
                assert o.finish_reason == "abort"
            live.pop(victim)
            finished.add(victim)
        for o in engine.step():
            produced[(o.request_id, o.index)] = produced.get((o.request_id, o.index), 0) + len(
                o.new_token_ids
            )
            assert (
                produced[(o.request_id, o.index)]
                <= live.get(o.request_id, SamplingParams()).max_tokens
                or o.request_id in finished
            )
        engine.check_integrity()
        for rid in [r for r in live if r not in engine.parents]:
            finished.add(rid)
            live.pop(rid)
    _drain(engine)
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks, "leaked blocks"
    assert not engine.kv.req_blocks and not engine.kv.swapped and not engine.parents
    assert engine.stats().num_preemptions > 0, "the pool was sized to force preemption"
    if mode == "swap":
        assert engine.scheduler.num_swapped_out > 0


def _peak_blocks(engine: EngineCore) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.num_blocks - engine.kv.pool.num_free_blocks)
    return peak


def test_n4_shares_prompt_blocks_and_matches_separate_seeds(tiny_llama):
    prompt = random_prompts(11, lengths=[203])[0]
    args = dict(
        model=str(tiny_llama),
        enable_prefix_caching=False,
        num_gpu_blocks_override=400,
        max_model_len=1024,
    )
    params = SamplingParams(n=4, temperature=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    forked = EngineCore(EngineArgs(**args))
    forked.add_request("n4", prompt, params)
    outs_forked: dict[int, list[int]] = {}
    peak_forked = 0
    while forked.has_unfinished_requests():
        for o in forked.step():
            outs_forked.setdefault(o.index, []).extend(o.new_token_ids)
        peak_forked = max(peak_forked, forked.num_blocks - forked.kv.pool.num_free_blocks)
        forked.check_integrity()
    separate = EngineCore(EngineArgs(**args))
    for i in range(4):
        separate.add_request(f"s{i}", prompt, params.for_sample(i))
    outs_sep: dict[str, list[int]] = {}
    peak_sep = 0
    while separate.has_unfinished_requests():
        for o in separate.step():
            outs_sep.setdefault(o.request_id, []).extend(o.new_token_ids)
        peak_sep = max(peak_sep, separate.num_blocks - separate.kv.pool.num_free_blocks)
    # 203 prompt tokens = 13 blocks; shared once with n=4, held four times by separate requests.
    assert peak_forked <= peak_sep - 30, (peak_forked, peak_sep)
    for i in range(4):
        assert outs_forked[i] == outs_sep[f"s{i}"], f"sample {i} differs from seed+{i} alone"
    assert len({tuple(v) for v in outs_forked.values()}) > 1, "samples should differ"


def test_seeded_sampling_independent_of_batch(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=64)
    target = random_prompts(12, lengths=[77])[0]
    params = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        seed=42,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=0.2,
    )
    alone = llm.generate([{"prompt_token_ids": target}], params)[0].outputs[0].token_ids
    others = random_prompts(13, lengths=[5 + 9 * i for i in range(40)])
    batch = (
        [{"prompt_token_ids": p} for p in others[:20]]
        + [{"prompt_token_ids": target}]
        + [{"prompt_token_ids": p} for p in others[20:]]
    )
    plist = (
        [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 20
        + [params]
        + [SamplingParams(temperature=0.5, seed=i, max_tokens=10) for i in range(20)]
    )
    together = llm.generate(batch, plist)[20].outputs[0].token_ids
    assert alone == together
    unseeded = llm.generate(
        [{"prompt_token_ids": target}] * 2,
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_logprobs_and_stop_tokens(tiny_llama):
    llm = LLM(str(tiny_llama))
    prompt = random_prompts(14, lengths=[30])[0]
    ref = hf_greedy(tiny_llama, [prompt], 12)[0]
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
    )[0]
    c = out.outputs[0]
    assert c.token_ids == ref and c.finish_reason == "length"
    assert len(c.logprobs) == 12
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.rank == 1 and lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-5
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    stop_at = ref[5]
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
    )[0]
    first = ref.index(stop_at)
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_bad_input_is_refused_and_engine_keeps_serving(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=512)
    good = random_prompts(15, lengths=[40])[0]
    with pytest.raises(PromptTooLongError, match="600 tokens.*512"):
        llm.generate([{"prompt_token_ids": good}, {"prompt_token_ids": [5] * 600}])
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.engine.add_request("v", [1, 99999], SamplingParams())
    assert not llm.engine.has_unfinished_requests(), "a refused request must leave nothing queued"
    out = llm.generate(
        [{"prompt_token_ids": good}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, [good], 8)[0]
    llm.engine.check_integrity()


def test_unknown_architecture_and_corrupt_weights(tiny_llama, tmp_path):
    bad_arch = tmp_path / "gpt"
    shutil.copytree(tiny_llama, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        LLM(str(bad_arch))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt|cannot read"):
        LLM(str(corrupt))
    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_llama, garbage)
    (garbage / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(64)
    )
    with pytest.raises(ModelLoadError):
        LLM(str(garbage))
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(tmp_path / "missing"))

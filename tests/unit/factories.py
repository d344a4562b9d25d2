"""Small factories for the engine-core unit tests: requests, pools, managers, schedulers."""

from __future__ import annotations

from shared.config import SchedulerConfig
from shared.engine.connector import KVConnector
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.scheduler_output import SampledToken, SchedulerOutput

BLOCK = 4  # tokens per block: small, so that exact block ids stay readable
SEED = 1234


def make_request(
    rid: str, prompt: list[int] | int, max_tokens: int = 8, n: int = 1, **params
) -> Request:
    """A sequence with ``prompt`` (or that many consecutive tokens from a start of its own, so
    that two such requests share no prefix) and greedy params."""
    if isinstance(prompt, int):
        start = 1000 + 100 * (sum(map(ord, rid)) % 50)
        tokens = list(range(start, start + prompt))
    else:
        tokens = list(prompt)
    p = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    leader = Request(
        request_id=rid if n == 1 else f"0_{rid}",
        parent_id=rid,
        index=0,
        prompt_token_ids=tuple(tokens),
        sampling_params=p.for_sample(0) if n > 1 else p,
        eos_token_ids=(2,),
        block_size=BLOCK,
        hash_seed=SEED,
    )
    leader.siblings = [
        Request(
            request_id=f"{i}_{rid}",
            parent_id=rid,
            index=i,
            prompt_token_ids=tuple(tokens),
            sampling_params=p.for_sample(i),
            eos_token_ids=(2,),
            block_size=BLOCK,
            hash_seed=SEED,
        )
        for i in range(1, n)
    ]
    return leader


def make_scheduler(
    num_blocks: int = 16,
    max_num_seqs: int = 8,
    budget: int = 64,
    caching: bool = True,
    mode: str = "recompute",
    host_blocks: int = 0,
    connector: KVConnector | None = None,
    max_model_len: int = 64,
    long_prefill: int = 0,
    prefill_while_decoding: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, caching, host_blocks)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        preemption_mode=mode,
        long_prefill_token_threshold=long_prefill,
        max_prefill_tokens_while_decoding=prefill_while_decoding,
    )
    return Scheduler(cfg, kv, connector)


def sample_all(out: SchedulerOutput, token: int = 7) -> dict[str, SampledToken]:
    """A fake runner's answer: ``token`` for every draw of the step."""
    return {spec.seq_id: SampledToken(token) for s in out.scheduled for spec in s.samples}


def step(sched: Scheduler, token: int = 7):
    """One schedule + update with every draw answered by ``token``; returns (output, updates)."""
    out = sched.schedule()
    updates, failures = sched.update_from_output(out, sample_all(out, token))
    assert failures == []
    return out, updates


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.seq_id: s.num_new_tokens for s in out.scheduled}

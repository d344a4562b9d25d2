"""Reference generation with ``transformers`` and prompt factories for engine tests."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

PROMPT_LENGTHS = [
    1,
    2,
    3,
    5,
    7,
    11,
    15,
    16,
    17,
    24,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    96,
    127,
    128,
    129,
    200,
    255,
    256,
    257,
    384,
    500,
    640,
    777,
    850,
    960,
    1000,
]


def random_prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(seed: int, n: int = 32, vocab: int = 2048) -> list[list[int]]:
    """``n`` prompts built from 4 long shared prefixes plus short unique suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(L)] for L in (160, 333, 512, 700)]
    out = []
    for i in range(n):
        p = prefixes[i % 4]
        out.append(p + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))])
    return out


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # compare fixed-length outputs
    return model


_cache: dict[tuple, list[int]] = {}


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from ``transformers``' own ``generate``, one prompt at a time."""
    model = _hf_model(str(model_dir))
    outs = []
    for p in prompts:
        key = (str(model_dir), tuple(p), max_new_tokens)
        if key not in _cache:
            ids = torch.tensor([p])
            with torch.no_grad():
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=0,
                )
            _cache[key] = gen[0, len(p) :].tolist()
        outs.append(_cache[key])
    return outs


def mismatches(ours: list[list[int]], ref: list[list[int]]) -> list[str]:
    bad = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            bad.append(
                f"prompt {i}: first difference at output token {j}: ours {a[j : j + 4]} vs hf {b[j : j + 4]}"
            )
    return bad


def teacher_forced_argmax(model_dir: Path, tokens: list[int], **kw) -> torch.Tensor:
    """Argmax of the next-token logits at every position of ``tokens`` (one prefill)."""
    return teacher_forced_argmaxes(model_dir, [tokens], **kw)[0]


def teacher_forced_argmaxes(model_dir: Path, seqs: list[list[int]], **kw) -> list[torch.Tensor]:
    """``teacher_forced_argmax`` of each sequence, one prefill each, on one engine."""
    from shared.config import EngineArgs
    from shared.engine.core import EngineCore

    core = EngineCore(EngineArgs(model=str(model_dir), device="cpu", kv_cache_memory="32MiB", **kw))
    return [prefill_logits(core.runner, tokens).argmax(-1) for tokens in seqs]


def fresh_cache(runner, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed KV cache of just enough blocks for ``n`` tokens of one sequence, and its block
    table (blocks 0, 1, ...)."""
    nb = -(-n // runner.block_size)
    kv = torch.zeros((nb, *runner.block_shape), dtype=runner.kv_dtype)
    return kv, torch.arange(nb, dtype=torch.int32).unsqueeze(0)


def one_sequence_meta(start: int, n: int, blocks: torch.Tensor, decode: bool = False):
    """Attention metadata of one sequence computing tokens ``[start, start + n)`` in the
    cache of ``fresh_cache``."""
    from shared.models.llama import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.arange(start, start + n),
        block_tables=blocks,
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        decode_only=decode,
    )


def prefill_logits(runner, tokens: list[int]) -> torch.Tensor:
    """fp32 next-token logits at every position of ``tokens``, from one prefill of the
    runner's model on a fresh cache."""
    n = len(tokens)
    kv, blocks = fresh_cache(runner, n)
    with torch.inference_mode():
        h = runner.model(torch.tensor(tokens), torch.arange(n), kv, one_sequence_meta(0, n, blocks))
        return runner.model.compute_logits(h).float()

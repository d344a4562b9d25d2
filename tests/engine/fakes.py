"""A fake model runner and a config-only model directory, for engine tests that need no model.

``FakeRunner`` follows ``ModelRunner``'s contract (``execute(SchedulerOutput)`` -> sampled token
per sequence id) with a deterministic "model": the next token is a hash of the sequence's tokens
so far, so outputs are reproducible and depend on everything the scheduler fed. Tests can make
chosen sequences fail to sample (``fail_sampling``) or the whole forward pass raise
(``fail_forward``).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.scheduler import SampledToken, SampleError, SchedulerOutput

EOS = 2


def write_config_dir(path: Path, vocab: int = 97, max_len: int = 512) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": max_len, "eos_token_id": EOS,
        "torch_dtype": "float32"}))
    return path


def next_token(tokens: list[int], vocab: int) -> int:
    h = 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % 1_000_000_007
    tok = h % vocab
    return tok if tok != EOS else 3


class FakeRunner:
    block_bytes = 1024

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.steps: list[SchedulerOutput] = []
        self.fail_sampling: set[str] = set()  # sequence ids whose sampling fails
        self.fail_forward = False

    def kv_cache_budget(self) -> int:
        return 64 * self.block_bytes

    def num_blocks_for(self, budget: int) -> int:
        return budget // self.block_bytes

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken | SampleError]:
        self.steps.append(out)
        if self.fail_forward:
            raise RuntimeError("forward pass failed (injected)")
        sampled: dict[str, SampledToken | SampleError] = {}
        for s in out.scheduled:
            if not s.sample:
                continue
            req = s.request
            first = req.num_output_tokens == req.num_resumed_tokens
            for seq in [req] + (req.siblings if first else []):
                if seq.request_id in self.fail_sampling:
                    sampled[seq.request_id] = SampleError("sampling failed (injected)")
                else:
                    toks = seq.all_token_ids + [seq.index]
                    sampled[seq.request_id] = SampledToken(next_token(toks, self.vocab))
        return sampled


def fake_engine(tmp_path: Path, num_blocks: int = 64, vocab: int = 97, **engine_args) -> EngineCore:
    """An ``EngineCore`` over ``FakeRunner`` with exactly ``num_blocks`` KV blocks."""
    model = write_config_dir(tmp_path / "model", vocab=vocab)
    engine_args.setdefault("max_model_len", 64)
    engine_args.setdefault("max_num_seqs", 8)
    engine_args.setdefault("max_num_batched_tokens", 64)
    args = EngineArgs(model=str(model), num_gpu_blocks_override=num_blocks, device="cpu",
                      **engine_args)
    return EngineCore(args, runner=FakeRunner(vocab))

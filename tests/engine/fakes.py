"""A fake model runner and a config-only model directory, for engine tests that need no model.

``FakeRunner`` follows ``ModelRunner``'s contract: it reads nothing but the plain-data
``SchedulerOutput`` and answers one draw per ``SampleSpec``. Its "model" keeps a KV cache of one
token per slot: every step writes each chunk's tokens into their slots (block table + position),
runs the block copies and swaps, and draws the next token from a hash of the tokens it reads
back through the block table. So a wrong block table, slot, copy-on-write or swap changes the
output, and reading a slot nobody wrote raises (as attending over garbage would be a bug). Tests
can make chosen sequences fail to sample (``fail_sampling``) or the forward pass raise
(``fail_forward``).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.config import EngineArgs
from shared.engine import EngineCore
from shared.engine.connector import connector_for_role
from shared.engine.request import Logprob
from shared.engine.scheduler_output import SampledToken, SampleError, SampleResult, SchedulerOutput

EOS = 2


def write_config_dir(path: Path, vocab: int = 97, max_len: int = 512) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": max_len,
                "eos_token_id": EOS,
                "torch_dtype": "float32",
            }
        )
    )
    return path


def next_token(tokens: list[int], vocab: int, salt: int = 0) -> int:
    h = salt % 1_000_000_007
    for t in tokens:
        h = (h * 1000003 + t + 1) % 1_000_000_007
    tok = h % vocab
    return tok if tok != EOS else 3


class UnwrittenKVError(AssertionError):
    """A sequence attended over a slot that no step or transfer wrote."""


class FakeRunner:
    block_bytes = 1024

    def __init__(self, vocab: int, block_size: int) -> None:
        self.vocab = vocab
        self.block_size = block_size
        self.steps: list[SchedulerOutput] = []
        self._prompt_lps: dict[str, list[Logprob]] = {}
        self.fail_sampling: set[str] = set()  # sequence ids whose sampling fails
        self.fail_forward = False
        self.kv: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}

    def kv_cache_budget(self) -> int:
        return 64 * self.block_bytes

    def num_blocks_for(self, budget: int) -> int:
        return budget // self.block_bytes

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks

    def _block(self, block_id: int) -> list[int | None]:
        return self.kv.setdefault(block_id, [None] * self.block_size)

    def write(self, block_ids, start: int, tokens) -> None:
        """Write ``tokens`` at positions ``start..`` of a sequence with ``block_ids`` (tests use
        it to play a prefill worker's transfer)."""
        bs = self.block_size
        for j, t in enumerate(tokens):
            p = start + j
            self._block(block_ids[p // bs])[p % bs] = t

    def read(self, block_ids, length: int) -> list[int]:
        bs = self.block_size
        out = []
        for p in range(length):
            t = self._block(block_ids[p // bs])[p % bs]
            if t is None:
                raise UnwrittenKVError(
                    f"position {p} (block {block_ids[p // bs]}) was never written"
                )
            out.append(t)
        return out

    def take_prompt_logprobs(self) -> dict[str, list[Logprob]]:
        """The last step's prompt logprobs: for the target at prompt position p, logprob
        -p and rank (token % 7) + 1, so a test can tell which positions came back."""
        out, self._prompt_lps = self._prompt_lps, {}
        return out

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        self.steps.append(out)
        self._prompt_lps = {
            s.seq_id: [
                Logprob(-float(s.start + 1 + i), t % 7 + 1, [])
                for i, t in enumerate(s.prompt_logprob_targets)
            ]
            for s in out.scheduled
            if s.prompt_logprob_targets
        }
        for s, d in out.blocks_to_copy:  # in the model runner's order (_move_blocks)
            self.kv[d] = list(self._block(s))
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self._block(d))
        for h, d in out.blocks_to_swap_in:
            self.kv[d] = list(self.host[h])
        if self.fail_forward:
            raise RuntimeError("forward pass failed (injected)")
        sampled: dict[str, SampleResult] = {}
        for s in out.scheduled:
            self.write(s.block_ids, s.start, s.token_ids)
            if not s.samples:
                continue
            history = self.read(s.block_ids, s.start + len(s.token_ids))
            for spec in s.samples:
                if spec.seq_id in self.fail_sampling:
                    sampled[spec.seq_id] = SampleError("sampling failed (injected)")
                else:
                    salt = (spec.params.seed or 0) + spec.num_output_tokens * 7919
                    sampled[spec.seq_id] = SampledToken(next_token(history, self.vocab, salt))
        return sampled


def fake_engine(
    tmp_path: Path, num_blocks: int = 64, vocab: int = 97, role: str = "none", **engine_args
) -> EngineCore:
    """An ``EngineCore`` over ``FakeRunner`` with exactly ``num_blocks`` KV blocks and the
    connector of ``role`` ("prefill", "decode" or "none")."""
    model = write_config_dir(tmp_path / "model", vocab=vocab)
    engine_args.setdefault("max_model_len", 64)
    engine_args.setdefault("max_num_seqs", 8)
    engine_args.setdefault("max_num_batched_tokens", 64)
    args = EngineArgs(
        model=str(model), num_gpu_blocks_override=num_blocks, device="cpu", **engine_args
    )
    return EngineCore(
        args, runner=FakeRunner(vocab, args.block_size), connector=connector_for_role(role)
    )

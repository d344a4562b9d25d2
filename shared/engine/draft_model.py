"""The draft-model proposer of speculative decoding (``method: draft_model``).

The draft model (same vocabulary and tokenizer as the target, checked at start-up) keeps its KV
in a twin pool indexed by the *target's* block ids: block ``b`` of the draft pool holds the
draft's KV for the tokens of target block ``b``, so the draft needs no allocator of its own and
follows every block-table change. What the twin pool holds for a sequence is valid up to
``min(computed, the step's start)`` positions, and only while the sequence's block table still
begins with the blocks it was computed in (preemption, swap and prefix-cache sharing change
them); everything past that is recomputed ("catch-up", one batched prefill of the draft over the
missing positions). So a decode worker rebuilds the draft's KV for a prompt whose target KV
arrived from a prefill worker, and nothing about the draft crosses the wire.

Per step, for the sequences the scheduler gave ``k`` lookahead slots: one draft forward over each
sequence's catch-up positions and its last token (sample draft 1 from its last row), then
``k - 1`` single-token forwards (drafts 2..k). Greedy requests take the draft's argmax; sampled
ones draw from the draft's distribution ``q`` (kept for the target's rejection sampling), seeded
rows from their own (seed, position) stream.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from shared.config import ConfigError, EngineArgs, SpeculativeConfig
from shared.engine.model_runner import pack_chunks, zeroed_host_tensor
from shared.engine.scheduler_output import ScheduledSeq, SchedulerOutput, position_spec
from shared.models.loader import load_model

logger = logging.getLogger(__name__)


def _vocab(model_dir: str) -> dict | None:
    f = Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text()).get("model", {}).get("vocab")


class DraftModelProposer:
    """``num_blocks``: the twin pool's blocks (the target pool's); ``None`` loads the weights
    only (the engine sizes its KV pools with the draft's weights in memory and its twin pool
    in the budget, :attr:`block_bytes`, then calls :meth:`allocate_kv`)."""

    def __init__(self, runner, spec: SpeculativeConfig, num_blocks: int | None = None) -> None:  # type: ignore[no-untyped-def]
        target = runner.model_config
        assert spec.model is not None
        cfg = EngineArgs(
            model=spec.model, dtype=target.dtype, max_model_len=target.max_model_len
        ).create_model_config()
        if cfg.vocab_size != target.vocab_size:
            raise ConfigError(
                f"draft model {spec.model} has a vocabulary of {cfg.vocab_size} tokens, the "
                f"target {target.vocab_size}: speculative decoding needs the same tokenizer"
            )
        dv, tv = _vocab(spec.model), _vocab(target.path)
        if dv is not None and tv is not None and dv != tv:
            raise ConfigError(
                f"draft model {spec.model} and the target {target.path} have different "
                "tokenizers (tokenizer.json vocabularies differ)"
            )
        self.runner = runner
        self.config = cfg
        self.device = runner.device
        self.backend = runner.backend
        self.model = load_model(cfg, str(self.device), self.backend)
        self.block_size = runner.block_size
        # the catch-up forward's bound (what the CUDA profile sized activations for)
        self.max_forward_tokens = max(1, runner.scheduler_config.max_num_batched_tokens)
        self.kv: torch.Tensor | None = None
        # seq id -> (positions with valid draft KV, the block ids they were computed in)
        self.state: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.name = spec.model
        if num_blocks is not None:
            self.allocate_kv(num_blocks)

    @property
    def _block_shape(self) -> tuple[int, ...]:
        cfg = self.config
        return (cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the twin pool (one per block of the target's pool)."""
        n = 1
        for d in self._block_shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.config.dtype)).element_size()

    def allocate_kv(self, num_blocks: int) -> None:
        """The twin pool: ``num_blocks`` blocks, as many as the target's pool."""
        shape = (num_blocks, *self._block_shape)
        dtype = getattr(torch, self.config.dtype)
        if self.device.type == "cpu":
            self.kv = zeroed_host_tensor(shape, dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        nbytes = self.kv.numel() * self.kv.element_size()
        logger.info(
            "draft model %s: %d layers, KV twin pool %.2f GiB",
            self.name,
            self.config.num_layers,
            nbytes / (1 << 30),
        )

    def _valid(self, s: ScheduledSeq) -> int:
        done, blocks = self.state.get(s.seq_id, (0, ()))
        done = min(done, s.start)
        n_blocks = -(-done // self.block_size)
        if tuple(s.block_ids[:n_blocks]) != blocks[:n_blocks]:
            same = 0
            for a, b in zip(s.block_ids, blocks):
                if a != b:
                    break
                same += 1
            done = min(done, same * self.block_size)
        return done

    def _forward(self, chunks: list[tuple[ScheduledSeq, int, list[int]]]) -> torch.Tensor:
        """One draft forward: per sequence, tokens at positions ``start ..``; returns the
        logits of each sequence's last position ``[S, V]``."""
        assert self.kv is not None, "allocate_kv() first"
        ids, pos, meta = pack_chunks(
            [(s.block_ids, start, toks) for s, start, toks in chunks], self.block_size, self.device
        )
        hidden = self.model(ids, pos, self.kv, meta)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last])

    def _forward_bounded(self, chunks: list[tuple[ScheduledSeq, int, list[int]]]) -> torch.Tensor:
        """:meth:`_forward` in forwards of at most ``max_forward_tokens`` tokens (a long
        catch-up split by positions: its earlier pieces write the KV its last one reads);
        one forward, as before, where they fit."""
        limit = self.max_forward_tokens
        if sum(len(t) for _, _, t in chunks) <= limit:
            return self._forward(chunks)
        rows: list[torch.Tensor | None] = [None] * len(chunks)
        batch: list[tuple[int | None, tuple[ScheduledSeq, int, list[int]]]] = []
        n = 0

        def flush() -> None:
            nonlocal n
            if batch:
                logits = self._forward([c for _, c in batch])
                for j, (idx, _) in enumerate(batch):
                    if idx is not None:
                        rows[idx] = logits[j]
            batch.clear()
            n = 0

        for idx, (s, start, toks) in enumerate(chunks):
            off = 0
            while off < len(toks):
                take = min(len(toks) - off, limit - n)
                last = off + take == len(toks)
                batch.append((idx if last else None, (s, start + off, toks[off : off + take])))
                n += take
                off += take
                if n >= limit:
                    flush()
        flush()
        return torch.stack(rows)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(
        self, out: SchedulerOutput, sampler
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
        """Drafts for every lookahead sequence of ``out``, and the draft distributions of
        the sampled (non-greedy) ones ``[k, V]``."""
        work = [s for s in out.scheduled if s.num_lookahead]
        drafts: dict[str, list[int]] = {s.seq_id: [] for s in work}
        qs: dict[str, list[torch.Tensor]] = {s.seq_id: [] for s in work}
        chunks = []
        for s in work:
            valid = self._valid(s)
            context = list(s.all_token_ids[valid : s.start]) + list(s.token_ids)
            chunks.append((s, valid, context))
        live = chunks
        for _ in range(max(s.num_lookahead for s in work)):
            logits = self._forward_bounded(live)
            nxt = []
            for row, (s, start, toks) in enumerate(live):
                (spec,) = s.samples
                d = drafts[s.seq_id]
                pspec = position_spec(spec, d, len(d))
                if spec.grammar is not None:
                    # proposals under the grammar (else nearly every draft is refused); q is
                    # what they were drawn from
                    lg = sampler.processed_logits(logits[row : row + 1], [pspec])
                    sampler.mask_after(lg, spec, d)
                    if spec.params.greedy:
                        tok = int(lg.argmax())
                    else:
                        q = sampler._probs(lg, [pspec])
                        tok = int(sampler._race(q, [pspec], salt=3)[0])
                        qs[s.seq_id].append(q[0] / q[0].sum())
                elif spec.params.greedy and sampler.needs_rules(pspec):
                    # the argmax the target's verification takes: after the row's rules
                    # (logit_bias, allowed_token_ids, min_tokens, penalties)
                    tok = int(sampler.processed_logits(logits[row : row + 1], [pspec]).argmax())
                elif spec.params.greedy:
                    tok = int(sampler._greedy(logits[row : row + 1])[0])
                else:
                    q = sampler.processed_probs(logits[row : row + 1], [pspec])
                    tok = int(sampler._race(q, [pspec], salt=3)[0])
                    qs[s.seq_id].append(q[0] / q[0].sum())
                d.append(tok)
                end = start + len(toks)  # positions with draft KV now
                self.state[s.seq_id] = (end, tuple(s.block_ids))
                if len(d) < s.num_lookahead:
                    nxt.append((s, end, [tok]))
            live = nxt
            if not live:
                break
        keep = {s.seq_id for s in out.scheduled}
        for sid in [k for k in self.state if k not in keep]:
            del self.state[sid]
        probs = {sid: torch.stack(v) for sid, v in qs.items() if v}
        return drafts, probs

"""Batched sampling: penalties, temperature, min-p, top-k, top-p, seeded draws, logprobs.

Each row's own rules come first, on fp32 logits and in vLLM's order: ``allowed_token_ids``
(every other token to -inf), ``logit_bias`` (added to its tokens' logits), ``min_tokens``
(its ends to -inf), then the repetition / frequency / presence penalties (so these see the
biased logits); a structured-output grammar's mask after them, then temperature, min-p, top-k
and top-p (vLLM V1's order; top-p measures the mass min-p left, so the order matters). The
first three commute (-inf absorbs a finite bias). ``min_tokens`` bans the EOS and the stop
ids whatever ``ignore_eos`` says (vLLM). Where it would ban every allowed token, the allow-list
wins (the ban is skipped: some token must be drawn), as a grammar's end wins over
``min_tokens``; where a grammar allows none of the allowed tokens, the row may only end (EOS),
as for any grammar that allows nothing else. Greedy rows with any of these rules take the
argmax of the processed logits, and every path that draws or verifies a token (plain draws,
speculative verification, rejection sampling, the draft model's q) goes through the same rules
(``_apply_row_rules``).

Logprobs report the model's raw distribution (``log_softmax`` of the logits before any rule,
vLLM's default ``raw_logprobs``): a bias or an allow-list changes what is drawn, not the
reported logprob or rank of a token.

A seeded row draws its token with noise from a generator keyed by ``(seed, position)``, where
position is the index of the output token being drawn. The draw is the exponential race
``argmax(p / E)``, ``E ~ Exp(1)``, which samples exactly from ``p`` and depends on nothing but
the row's own probabilities and noise, so outputs do not depend on the batch.

Failures belong to rows: when the batched draw raises, each row is drawn alone and a row that
still fails comes back as a :class:`~shared.engine.scheduler.SampleError` (the engine fails that
request and serves the others), never as an exception for the whole batch.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xxhash

from shared.engine.request import Logprob
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SampledToken, SampleError, SampleSpec, SpecSample
from shared.engine.structured_output import Matchers

logger = logging.getLogger(__name__)
_U64 = (1 << 64) - 1


def _row_key(seed: int, position: int, salt: int = 0) -> int:
    """The 63-bit key of a seeded row's noise at output position ``position``."""
    # the same bytes as packing (seed, position) as int64 for every valid seed; the mask only
    # keeps a bug elsewhere from turning into struct.error on the engine thread. ``salt``
    # separates the streams of one position (speculative decoding's acceptance test and
    # residual draw); 0 is the plain draw's stream, unchanged.
    packed = struct.pack("<QQ", seed & _U64, position & _U64)
    if salt:
        packed += struct.pack("<Q", salt)
    return xxhash.xxh3_64_intdigest(packed) & ((1 << 63) - 1)


def _row_generator(
    seed: int, position: int, device: torch.device, salt: int = 0
) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_row_key(seed, position, salt))


def _cuts(r: SampleSpec) -> bool:
    """Row ``r`` samples from a cut distribution (top-k, top-p or min-p)."""
    p = r.params
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0


def _keep_matching(toks: list[SampledToken], drafts: Sequence[int]) -> SpecSample:
    """The drafts the target's own draws confirm, then its draw at the first that differs
    (or the bonus after the last)."""
    a = 0
    while a < len(drafts) and toks[a].token_id == drafts[a]:
        a += 1
    return SpecSample(toks[: a + 1], len(drafts), a)


def _last(spec: SampleSpec, drafts: Sequence[int]) -> int | None:
    """The token before the draw after ``drafts``: the last draft, else the last output."""
    if drafts:
        return int(drafts[-1])
    return int(spec.output_token_ids[-1]) if spec.output_token_ids else None


def _note_bans(
    bans: dict[int, tuple[list[int], list[int]]], grammar: object, row: int, last: int | None
) -> None:
    """Add ``row`` to the ban lists its grammar needs (JSON kinds): the control-byte and
    surrogate tokens, and after a token ending in 0xED the tokens that would complete a UTF-8
    surrogate. ``bans``: id(list) -> (list, rows), so each list is one indexed write."""
    g = grammar
    if g.banned:  # type: ignore[attr-defined]
        bans.setdefault(id(g.banned), (g.banned, []))[1].append(row)  # type: ignore[attr-defined]
    if last is not None and last in g.ends_ed:  # type: ignore[attr-defined]
        bans.setdefault(id(g.after_ed), (g.after_ed, []))[1].append(row)  # type: ignore[attr-defined]


class Sampler:
    """``argmax_rows`` is the attention backend's greedy argmax (``kernels`` contract);
    ``race_rows`` and ``cut_rows`` (optional, the CPU backend's ``kernels.cpu_paged``) draw a
    batch's rows in one pass each, the noise made in the kernel from a key per row, and make
    the top-k / top-p / min-p rows' weights without a sort; the sampler uses nothing else of the
    backend."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int | None,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
        race_rows: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
        | None = None,
        cut_rows: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._argmax_rows = argmax_rows or (lambda x: x.argmax(dim=-1))
        self._race_rows = race_rows if device.type == "cpu" else None
        self._cut_rows = cut_rows if self._race_rows is not None else None
        self.generator = torch.Generator(device=device)
        self.matchers = Matchers()  # structured outputs: one grammar matcher per sequence
        self._token_tensors: dict[int, tuple[list[int], torch.Tensor]] = {}
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        # the unseeded rows' noise (or its keys) on CPU (see _race); seeded like the torch
        # generator
        self._np_rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, rows: list[SampleSpec]
    ) -> list[SampledToken | SampleError]:
        # logits: [N, V] (model dtype), row i belongs to rows[i]
        try:
            return self._sample_batch(logits, rows)
        except Exception as e:  # noqa: BLE001 - find the rows it belongs to
            if len(rows) == 1:
                return [self._row_error(rows[0], e)]
        out: list[SampledToken | SampleError] = []
        for i, row in enumerate(rows):
            try:
                out.extend(self._sample_batch(logits[i : i + 1], [row]))
            except Exception as e:  # noqa: BLE001 - this row's request fails alone
                out.append(self._row_error(row, e))
        return out

    @staticmethod
    def _row_error(row: SampleSpec, e: Exception) -> SampleError:
        logger.error("sampling failed for request %s: %r", row.seq_id, e, exc_info=e)
        return SampleError(f"sampling failed: {type(e).__name__}: {e}")

    def _sample_batch(
        self, logits: torch.Tensor, rows: list[SampleSpec], drafts: Sequence[int] | None = None
    ) -> list[SampledToken]:
        """``drafts``: ``rows`` are the verified positions of one constrained sequence (see
        :meth:`_apply_grammar_walk`); its matcher then advances in :meth:`verify`, by the
        tokens kept, not here."""
        n = len(rows)
        want_lp = [r.params.logprobs is not None for r in rows]
        if self.plain_greedy(rows):
            return [SampledToken(t) for t in self._greedy(logits).tolist()]
        if (
            self._racing(logits, rows)
            and not any(want_lp)
            and not any(self._needs_processing(r) for r in rows)
        ):  # no rule of a row's own: the kernels read the logits as they are (greedy rows too)
            return [SampledToken(t) for t in self._race_logits(logits, rows).tolist()]
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        logits = logits.clone() if any(self._needs_processing(r) for r in rows) else logits
        self._apply_row_rules(logits, rows)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained and drafts is not None:
            self._apply_grammar_walk(logits, rows, drafts)
            constrained = []
        elif constrained:
            self._apply_grammars(logits, rows, constrained)
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == n:
            tokens = logits.argmax(dim=-1)
        else:
            if greedy:
                g = torch.tensor(greedy, device=logits.device)
                tokens[g] = logits[g].argmax(dim=-1)
            rand = [i for i in range(n) if not rows[i].params.greedy]
            if len(rand) == n:  # no copy of the rows (an indexed copy was 3 ms at 64 x 32,000)
                tokens = self._sample(logits, rows)
            else:
                tokens[torch.tensor(rand, device=logits.device)] = self._sample(
                    logits[rand], [rows[i] for i in rand]
                )
        token_list = tokens.tolist()
        ended = {i for i in constrained if self._advance(rows[i], token_list[i])}
        out = []
        for i, r in enumerate(rows):
            lp = None
            if want_lp[i]:
                lp = self._logprob(raw_logprobs[i], token_list[i], r.params.logprobs)
            out.append(SampledToken(token_list[i], lp, i in ended))
        return out

    def _advance(self, r: SampleSpec, token: int) -> bool:
        """Advance ``r``'s grammar matcher; True when the sequence ends with ``token``."""
        return self.matchers.accepted(r.seq_id, token, (*r.eos_token_ids, *r.params.stop_token_ids))

    def plain_greedy(self, rows: Sequence[SampleSpec]) -> bool:
        """Every row's draw is the argmax of its raw logits: greedy, no logprobs, no rule or
        grammar of its own (the model runner then asks for the argmax alone)."""
        return all(
            r.params.greedy and r.params.logprobs is None and not self._needs_processing(r)
            for r in rows
        )

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: [N, V] model dtype -> [N] ids; exact (an upcast changes no comparison)
        return self._argmax_rows(logits)

    @staticmethod
    def needs_rules(r: SampleSpec) -> bool:
        """Row ``r`` has rules of its own (``_apply_row_rules``) at this position."""
        p = r.params
        return (
            p.needs_penalties
            or p.biased
            or (p.min_tokens > 0 and r.num_output_tokens < p.min_tokens)
        )

    @classmethod
    def _needs_processing(cls, r: SampleSpec) -> bool:
        return cls.needs_rules(r) or r.grammar is not None

    def _apply_row_rules(self, logits: torch.Tensor, rows: list[SampleSpec]) -> None:
        """Each row's own rules, in place on fp32 logits (the order of the module docstring):
        ``allowed_token_ids``, ``logit_bias``, ``min_tokens`` bans its ends, then its
        repetition / frequency / presence penalties."""
        for i, r in enumerate(rows):
            p = r.params
            if p.biased:
                allowed, bias_ids, bias_values = self._bias_tensors(p, logits.device)
                if allowed is not None:
                    keep = logits[i, allowed]
                    logits[i] = float("-inf")
                    logits[i, allowed] = keep
                if bias_ids is not None:
                    logits[i].index_add_(0, bias_ids, bias_values.to(logits.dtype))
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                # vLLM bans every end (its all_stop_token_ids holds the EOS), ignore_eos or not
                banned = list(p.stop_token_ids) + list(r.eos_token_ids)
                if banned and p.allowed_token_ids is not None:
                    ban = set(banned)
                    if all(t in ban for t in p.allowed_token_ids):
                        banned = []  # the allow-list holds only ends: it wins over min_tokens
                if banned:
                    logits[i, banned] = float("-inf")
            if p.needs_penalties:
                self._apply_penalties(logits, i, r)

    @staticmethod
    def _bias_tensors(
        p: SamplingParams, dev: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(allowed ids, logit_bias ids, logit_bias values) on ``dev``, built once per request
        (cached on its params) and reused at every position."""
        key = f"bias:{dev}"
        cached = p.sampler_cache.get(key)
        if cached is None:
            allowed = None
            if p.allowed_token_ids is not None:
                allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)
            bias = p.logit_bias or {}
            ids = torch.tensor(list(bias), dtype=torch.long, device=dev) if bias else None
            values = torch.tensor(list(bias.values()), dtype=torch.float32, device=dev)
            cached = p.sampler_cache[key] = (allowed, ids, values)
        return cached  # type: ignore[return-value]

    def processed_logits(
        self, logits: torch.Tensor, rows: list[SampleSpec], drafts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """fp32 copy of ``logits`` with each row's rules applied (no temperature; the grammar
        only with ``drafts``, the verified positions of one constrained sequence)."""
        logits = logits.float().clone()
        self._apply_row_rules(logits, rows)
        if drafts is not None and rows and rows[0].grammar is not None:
            self._apply_grammar_walk(logits, rows, drafts)
        return logits

    def processed_probs(
        self, logits: torch.Tensor, rows: list[SampleSpec], drafts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The distribution each row samples from: its rules, then temperature, min-p, top-k
        and top-p (rows not normalised where top-p cuts)."""
        return self._probs(self.processed_logits(logits, rows, drafts), rows)

    def _apply_grammars(
        self, logits: torch.Tensor, rows: list[SampleSpec], constrained: list[int]
    ) -> None:
        """Mask every constrained row to the tokens its grammar allows next (one batched
        bitmask application); a finished grammar allows only the end of the sequence."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        masked = []
        # rows by the token list their grammar bans (one list per grammar kind): one write each
        bans: dict[int, tuple[list[int], list[int]]] = {}
        for i in constrained:
            r = rows[i]
            m = self.matchers.get(r.seq_id, r.grammar, r.output_token_ids)
            if m.is_terminated():  # type: ignore[attr-defined]
                self._only_end(logits, i, r)
                continue
            m.fill_next_token_bitmask(bitmask, i)  # type: ignore[attr-defined]
            masked.append(i)
            _note_bans(bans, r.grammar, i, r.output_token_ids[-1] if r.output_token_ids else None)
        self._mask_rows(logits, rows, bitmask, masked, bans)

    def _apply_grammar_walk(
        self, logits: torch.Tensor, rows: list[SampleSpec], drafts: Sequence[int]
    ) -> None:
        """The masks of a constrained sequence's verified positions: position ``j`` gets its
        grammar's mask as if ``drafts[:j]`` were accepted. The sequence's matcher walks the
        drafts and rolls back; after a draft the grammar refuses (or after its end) the
        positions can only end (the draft there is rejected whatever comes after)."""
        import xgrammar as xgr

        r0 = rows[0]
        m = self.matchers.get(r0.seq_id, r0.grammar, r0.output_token_ids)
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        masked: list[int] = []
        bans: dict[int, tuple[list[int], list[int]]] = {}
        walked = 0
        try:
            for j in range(len(rows)):
                if m.is_terminated():  # type: ignore[attr-defined]
                    break
                m.fill_next_token_bitmask(bitmask, j)  # type: ignore[attr-defined]
                masked.append(j)
                _note_bans(bans, r0.grammar, j, _last(r0, drafts[:j]))
                if j == len(drafts) or not m.accept_token(int(drafts[j])):  # type: ignore[attr-defined]
                    break
                walked += 1
        finally:
            if walked:
                m.rollback(walked)  # type: ignore[attr-defined]
        for jj in range(len(rows)):
            if jj not in masked:
                self._only_end(logits, jj, rows[jj])
        self._mask_rows(logits, rows, bitmask, masked, bans)

    def mask_after(self, logits: torch.Tensor, spec: SampleSpec, drafts: Sequence[int]) -> None:
        """Mask the one row of ``logits`` (fp32, in place) to what ``spec``'s grammar allows
        after ``drafts`` (the draft model proposing under a grammar: its q is then the
        distribution its drafts were drawn from, as rejection sampling needs)."""
        import xgrammar as xgr

        m = self.matchers.get(spec.seq_id, spec.grammar, spec.output_token_ids)
        walked = 0
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        try:
            for t in drafts:
                if m.is_terminated() or not m.accept_token(int(t)):  # type: ignore[attr-defined]
                    self._only_end(logits, 0, spec)
                    return
                walked += 1
            if m.is_terminated():  # type: ignore[attr-defined]
                self._only_end(logits, 0, spec)
                return
            m.fill_next_token_bitmask(bitmask, 0)  # type: ignore[attr-defined]
        finally:
            if walked:
                m.rollback(walked)  # type: ignore[attr-defined]
        bans: dict[int, tuple[list[int], list[int]]] = {}
        _note_bans(bans, spec.grammar, 0, _last(spec, drafts))
        self._mask_rows(logits, [spec], bitmask, [0], bans)

    def _mask_rows(
        self,
        logits: torch.Tensor,
        rows: list[SampleSpec],
        bitmask: torch.Tensor,
        masked: list[int],
        bans: dict[int, tuple[list[int], list[int]]],
    ) -> None:
        """Apply the grammar bitmask to the ``masked`` rows and the JSON bans (one write per
        ban list); a row left without any token may only end."""
        import xgrammar as xgr

        for banned, at in bans.values():
            cols = self._token_tensor(banned, logits.device)
            logits[torch.tensor(at, device=logits.device)[:, None], cols[None, :]] = float("-inf")
        if masked:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=masked
            )
            # where the grammar allows only the end and min_tokens banned it, the grammar wins:
            # no token could continue the output validly (the max over every row reads the
            # logits once; indexing the masked rows first would copy them)
            dead = (logits.amax(dim=-1) == float("-inf")).tolist()
            for i in masked:
                if dead[i]:
                    self._only_end(logits, i, rows[i])

    def _token_tensor(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """``ids`` as a long tensor, built once per list (the grammars' shared ban lists)."""
        hit = self._token_tensors.get(id(ids))
        if hit is None or hit[0] is not ids:
            hit = (ids, torch.tensor(ids, dtype=torch.long, device=device))
            self._token_tensors[id(ids)] = hit
        return hit[1]

    @staticmethod
    def _only_end(logits: torch.Tensor, i: int, r: SampleSpec) -> None:
        """Row ``i`` may only end the sequence (its EOS, else its stop ids), min_tokens or not."""
        keep = list(r.eos_token_ids) or list(r.params.stop_token_ids)
        logits[i] = float("-inf")
        if keep:
            logits[i, keep] = 0.0

    def _apply_penalties(self, logits: torch.Tensor, i: int, r: SampleSpec) -> None:
        p = r.params
        row = logits[i]
        dev = logits.device
        out_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
            seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
            if out_ids.numel():
                seen[out_ids] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        if out_ids.numel() and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(out_ids, minlength=self.vocab_size)[: row.shape[0]].to(
                row.dtype
            )
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _sample(self, logits: torch.Tensor, rows: list[SampleSpec]) -> torch.Tensor:
        # logits: [M, V] for non-greedy rows -> sampled ids [M]
        if self._racing(logits, rows):
            return self._race_logits(logits, rows)
        return self._race(self._probs(logits, rows), rows)

    def _racing(self, x: torch.Tensor, rows: list[SampleSpec] | None = None) -> bool:
        """Whether ``x``'s rows (logits of ``rows``; weights when ``None``) go to the backend's
        kernels (``race_rows``, and ``cut_rows`` for top-k / top-p / min-p rows)."""
        return (
            self._race_rows is not None
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and (rows is None or self._cut_rows is not None or not any(map(_cuts, rows)))
        )

    def _race_logits(self, logits: torch.Tensor, rows: list[SampleSpec]) -> torch.Tensor:
        """Each row's draw from its logits by the backend's kernels: temperature (0: the
        argmax), then min-p / top-k / top-p where a row asks (``cut_rows``), then the race."""
        assert self._race_rows is not None
        temps = torch.tensor(
            [0.0 if r.params.greedy else r.params.temperature for r in rows], dtype=torch.float32
        )
        keys = self._keys(rows)
        if not any(map(_cuts, rows)):
            return self._race_rows(logits, temps, keys)
        assert self._cut_rows is not None
        weights = self._cut_rows(
            logits,
            temps,
            torch.tensor([r.params.top_k for r in rows], dtype=torch.long),
            torch.tensor([r.params.top_p for r in rows], dtype=torch.float32),
            torch.tensor([r.params.min_p for r in rows], dtype=torch.float32),
        )
        return self._race_rows(weights, None, keys)

    def _keys(self, rows: list[SampleSpec], salt: int = 0) -> torch.Tensor:
        """Each row's noise key for ``race_rows``: a seeded row's from (seed, position, salt),
        so its draw depends on nothing else; the others' from the engine's seeded stream."""
        fresh = sum(1 for r in rows if r.params.seed is None)
        drawn = iter(
            self._np_rng.integers(0, 1 << 63, size=fresh, dtype=np.int64).tolist() if fresh else ()
        )
        return torch.tensor(
            [
                next(drawn)
                if r.params.seed is None
                else _row_key(r.params.seed, r.num_output_tokens, salt)
                for r in rows
            ],
            dtype=torch.long,
        )

    def _probs(self, logits: torch.Tensor, rows: list[SampleSpec]) -> torch.Tensor:
        """The distribution each non-greedy row samples from: temperature, then (vLLM V1's
        order) min-p, top-k and top-p, applied to already penalised logits; unnormalised where
        top-p cuts. Min-p comes first because top-p renormalises: it keeps the smallest prefix
        reaching ``top_p`` of the mass min-p left, not of the whole row's."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
        logits = logits / temps
        min_p = [r.params.min_p for r in rows]
        if any(min_p):  # drop what is below min_p times the largest probability
            probs = torch.softmax(logits, dim=-1)
            mp = torch.tensor(min_p, device=dev).unsqueeze(1)
            cut = probs < mp * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(cut, float("-inf"))
        top_k = [r.params.top_k for r in rows]
        if any(top_k):
            k = torch.tensor([kk if kk > 0 else logits.shape[1] for kk in top_k], device=dev)
            k = k.clamp(max=logits.shape[1])
            sorted_vals = logits.sort(dim=-1, descending=True).values
            kth = sorted_vals.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = [r.params.top_p for r in rows]
        if any(tp < 1.0 for tp in top_p):
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(dim=-1)
            tp = torch.tensor(top_p, device=dev).unsqueeze(1)
            drop = (cum - sp) > tp  # keep the smallest prefix whose mass reaches top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, si, sp)
        return probs

    def _race(self, probs: torch.Tensor, rows: list[SampleSpec], salt: int = 0) -> torch.Tensor:
        """One draw per row from ``probs`` (any non-negative weights): ``argmax(p / E)``, the
        noise ``E ~ Exp(1)`` keyed by (seed, position[, salt]) for seeded rows."""
        if self._racing(probs):
            assert self._race_rows is not None
            return self._race_rows(probs, None, self._keys(rows, salt))
        dev = probs.device
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            shape = (len(unseeded), probs.shape[1])
            if dev.type == "cpu":
                # torch's CPU exponential_ draws one element at a time: 0.55 ms per row of a
                # 32,000-token vocabulary, 35 ms for a decode step of 64 sampled rows. -log U
                # of numpy's vectorised uniform draw is the same Exp(1) at ~1/9 the time (U = 0
                # gives E = inf: weight 0). docs/benchmarks.md, "Sampling noise on CPU".
                u = torch.from_numpy(self._np_rng.random(shape, dtype=np.float32))
                e = u.log_().neg_()
            else:
                e = torch.empty(shape, device=dev).exponential_(generator=self.generator)
            if len(unseeded) == len(rows):
                noise = e.to(probs.dtype)
            else:
                noise[unseeded] = e.to(probs.dtype)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = _row_generator(r.params.seed, r.num_output_tokens, dev, salt)
                if dev.type == "cpu":  # -log U, U from the row's own stream (as above)
                    row = torch.empty(probs.shape[1], device=dev).uniform_(generator=g)
                    noise[i] = row.log_().neg_()
                else:
                    noise[i].exponential_(generator=g)
        return self._argmax_rows(probs / noise)  # the backend's: torch's fp32 argmax is ~5x slower

    # ---- speculative decoding ---------------------------------------------------------
    @torch.inference_mode()
    def verify(
        self,
        logits: torch.Tensor,
        rows: list[SampleSpec],
        drafts: list[int],
        draft_probs: torch.Tensor | None = None,
    ) -> SpecSample | SampleError:
        """Verify ``k = len(drafts)`` drafts from the target's logits at their ``k + 1``
        positions (``rows[j]``: the draw at position j, as if ``drafts[:j]`` were sampled).

        Greedy rows, and every row of an n-gram proposal (a one-hot ``q``): draw the target's
        token at each position exactly as without speculation (argmax, or the race with the
        position's noise) and keep drafts while they equal it; the first that differs is
        replaced by it (the target's sample given that the draft was rejected: rejection
        sampling with a one-hot q). Output and seeded streams are those of plain decoding.
        Sampled rows with a draft model's distributions ``draft_probs`` ``[k, V]``: rejection
        sampling, accept ``d`` with ``min(1, p(d) / q(d))``, else draw from ``max(p - q, 0)``;
        a bonus draw from the last position when every draft is accepted."""
        params = rows[0].params
        if rows[0].grammar is not None:
            try:
                return self._verify_constrained(logits, rows, drafts, draft_probs)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                return self._row_error(rows[0], e)
        if draft_probs is None or params.greedy:
            draws = self(logits, rows)
            for d in draws:
                if isinstance(d, SampleError):
                    return d
            return _keep_matching([d for d in draws if isinstance(d, SampledToken)], drafts)
        try:
            return self._rejection(logits, rows, drafts, draft_probs)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            return self._row_error(rows[0], e)

    def _verify_constrained(
        self,
        logits: torch.Tensor,
        rows: list[SampleSpec],
        drafts: list[int],
        draft_probs: torch.Tensor | None,
    ) -> SpecSample:
        """:meth:`verify` for a sequence under a grammar: each position drawn under the mask
        it would have had in plain decoding; the matcher then advances by the tokens kept."""
        if draft_probs is None or rows[0].params.greedy:
            result = _keep_matching(self._sample_batch(logits, rows, drafts=drafts), drafts)
        else:
            result = self._rejection(logits, rows, drafts, draft_probs, constrained=True)
        kept: list[SampledToken] = []
        for t in result.tokens:
            if self._advance(rows[0], t.token_id):  # a forced end: the row ends here
                kept.append(SampledToken(t.token_id, t.logprob, True))
                return SpecSample(kept, result.num_drafts, min(result.num_accepted, len(kept) - 1))
            kept.append(t)
        return result

    def _rejection(
        self,
        logits: torch.Tensor,
        rows: list[SampleSpec],
        drafts: list[int],
        q: torch.Tensor,
        constrained: bool = False,
    ) -> SpecSample:
        k = len(drafts)
        want_lp = rows[0].params.logprobs is not None
        raw = torch.log_softmax(logits.float(), dim=-1) if want_lp else None
        probs = self.processed_probs(logits, rows, drafts if constrained else None)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        q = q.float()
        out: list[SampledToken] = []

        def tok(i: int, t: int) -> SampledToken:
            lp = self._logprob(raw[i], t, rows[i].params.logprobs) if raw is not None else None
            return SampledToken(t, lp)

        for i, d in enumerate(drafts):
            u = self._uniform(rows[i])
            ratio = float(probs[i, d]) / max(float(q[i, d]), 1e-30)
            if u < min(1.0, ratio):
                out.append(tok(i, d))
                continue
            resid = (probs[i] - q[i]).clamp_min(0.0)
            if float(resid.sum()) <= 0.0:
                resid = probs[i]
            t = int(self._race(resid.unsqueeze(0), [rows[i]], salt=1)[0])
            out.append(tok(i, t))
            return SpecSample(out, k, i)
        t = int(self._race(probs[k : k + 1], [rows[k]])[0])
        out.append(tok(k, t))
        return SpecSample(out, k, k)

    def _uniform(self, row: SampleSpec) -> float:
        if row.params.seed is not None:
            g = _row_generator(row.params.seed, row.num_output_tokens, self.device, salt=2)
            return float(torch.rand(1, generator=g, device=self.device))
        return float(torch.rand(1, generator=self.generator, device=self.device))

    @staticmethod
    def _logprob(raw: torch.Tensor, token: int, top_n: int) -> Logprob:
        lp = raw[token]
        rank = int((raw > lp).sum().item()) + 1
        top: list[tuple[int, float]] = []
        if top_n:
            vals, ids = raw.topk(top_n)
            top = list(zip(ids.tolist(), vals.tolist()))
        return Logprob(float(lp), rank, top)

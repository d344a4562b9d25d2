"""Structured outputs (vLLM's ``structured_outputs`` / ``response_format``) through xgrammar.

``GrammarCompiler`` compiles a request's JSON schema, regex, choice list, EBNF grammar or "any
JSON object" once per distinct spec (xgrammar's compiler caches by spec, up to
``PDSERVE_GRAMMAR_CACHE_MIB``; an LRU of ours keeps the compiled handles). A worker compiles
on threads of its own (:func:`compile_executor`, half the CPUs as vLLM's), for at most
``PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S``, before the request reaches the engine thread, so the
engine thread only finds it in the cache. The sampler keeps one ``GrammarMatcher`` per
constrained sequence, rebuilt from the sequence's output tokens wherever it lacks one (a decode
worker continuing a prefill worker's first token, a resumed stream), applies every constrained
row's token bitmask to the logits in one call, and advances the matcher with each sampled
token. Requests without a grammar pay nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

from shared.config import env_float, env_int
from shared.daemon_pool import DaemonPool
from shared.engine.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)
_CACHE = 256  # compiled grammars kept
#: The bound of xgrammar's own compiler cache, MiB (PDSERVE_GRAMMAR_CACHE_MIB; 0: no cache).
#: Unbounded by default in xgrammar: every distinct schema a client sent stayed in memory
#: (about 16 KiB for a small one), whatever our LRU of compiled handles keeps.
GRAMMAR_CACHE_MIB = 512


def grammar_cache_bytes() -> int:
    """xgrammar's compiler cache bound in bytes (``PDSERVE_GRAMMAR_CACHE_MIB``; 0: off)."""
    return env_int("PDSERVE_GRAMMAR_CACHE_MIB", GRAMMAR_CACHE_MIB) << 20


#: How long a worker waits for one grammar to compile, s (PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S;
#: 0: no bound). Past it the request is refused as too complex; the compile cannot be
#: interrupted and finishes on its thread (then cached, for nobody in particular).
GRAMMAR_COMPILE_TIMEOUT_S = 60.0


def grammar_compile_timeout_s() -> float:
    """The bound on one grammar's compile, seconds (0: none)."""
    return env_float("PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", GRAMMAR_COMPILE_TIMEOUT_S)


def check_environment() -> None:
    """Read the structured-output settings once at start-up, so that a bad value is a
    :class:`~shared.config.ConfigError` then, not at the first constrained request."""
    grammar_cache_bytes()
    grammar_compile_timeout_s()


_executor: DaemonPool | None = None
_executor_lock = threading.Lock()


def compile_executor() -> DaemonPool:
    """The threads grammars compile on: half the CPUs (vLLM's choice), apart from asyncio's
    default executor, which a worker's drain and shutdown also need. Daemon threads: a compile
    that outlived its request's wait cannot be interrupted, and must not keep a worker that
    should exit (its engine died, SIGTERM) alive until it ends."""
    global _executor
    with _executor_lock:
        if _executor is None:
            workers = max(1, ((os.cpu_count() or 2) + 1) // 2)
            _executor = DaemonPool(workers, "pdserve-grammar")
        return _executor


class StructuredOutputError(SamplingParamsError):
    """The schema, regex or grammar does not compile (the request is refused, named)."""


class Compiled:
    """A compiled grammar and what its kind never allows beyond it. For JSON: every token with
    a control byte (0x00-0x1f: compact JSON needs none, strings must escape them) and every
    UTF-8 surrogate encoding (0xED then 0xA0-0xBF, inside a token or across two). xgrammar's
    JSON string rule lets both through (seen with a random model), and strict parsers (Python's
    ``json``, pydantic) refuse them."""

    __slots__ = ("grammar", "banned", "ends_ed", "after_ed")

    def __init__(
        self,
        grammar: object,
        banned: list[int],
        ends_ed: frozenset[int] = frozenset(),
        after_ed: list[int] | None = None,
    ) -> None:
        self.grammar = grammar
        self.banned = banned
        self.ends_ed = ends_ed  # tokens ending in 0xED: the next may not start with 0xA0-0xBF
        self.after_ed = after_ed or []


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._info = None
        self._cache: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._control: list[int] = []
        self._ends_ed: frozenset[int] = frozenset()
        self._after_ed: list[int] = []
        self._lock = threading.Lock()  # the cache and the compiles in progress
        self._setup_lock = threading.Lock()  # the one-time tokenizer info and compiler
        self._pending: dict[tuple[str, str], Future[Compiled]] = {}

    def _ensure_compiler(self) -> None:
        """Build xgrammar's tokenizer info and compiler on first use (not at start-up)."""
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import PreTrainedTokenizerFast

            tok_file = Path(self.model_dir) / "tokenizer.json"
            tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
            self._info = xgr.TokenizerInfo.from_huggingface(
                tok, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
            )
            limit = grammar_cache_bytes()
            self._compiler = xgr.GrammarCompiler(
                self._info,
                max_threads=2,
                cache_enabled=limit > 0,
                cache_limit_bytes=limit if limit > 0 else -1,
            )
            special = set(self.eos_token_ids)
            vocab = self._info.decoded_vocab
            self._control = [
                i
                for i, b in enumerate(vocab)
                if i not in special
                and (
                    any(c < 0x20 for c in b)
                    or any(b[j] == 0xED and 0xA0 <= b[j + 1] <= 0xBF for j in range(len(b) - 1))
                )
            ]
            self._ends_ed = frozenset(i for i, b in enumerate(vocab) if b and b[-1] == 0xED)
            self._after_ed = [i for i, b in enumerate(vocab) if b and 0xA0 <= b[0] <= 0xBF]

    def compile(self, so: StructuredOutputsParams) -> Compiled:
        """The compiled grammar of ``so`` (cached); ``StructuredOutputError`` if it fails.

        The lock covers only the cache: a cold compile (milliseconds to seconds for a large
        schema) runs outside it, so other specs' cache hits and compiles never wait behind it;
        callers asking for a spec being compiled wait for that one compile."""
        key = so.kind()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = mine = Future()
        if pending is not None:
            return pending.result()
        try:
            compiled = self._build(key, so)
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._pending[key]
            self._cache[key] = compiled
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        mine.set_result(compiled)
        return compiled

    def _build(self, key: tuple[str, str], so: StructuredOutputsParams) -> Compiled:
        with self._setup_lock:
            self._ensure_compiler()
        kind, spec = key
        try:
            # compact JSON (no free whitespace between tokens): a model cannot drift into
            # unbounded whitespace before max_tokens (vLLM's disable_any_whitespace)
            if kind == "json":
                json.loads(spec)  # a clear error for text that is not JSON
                cg = self._compiler.compile_json_schema(spec, any_whitespace=False)  # type: ignore[attr-defined]
            elif kind == "json_object":
                cg = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)  # type: ignore[attr-defined]
            elif kind == "regex":
                cg = self._compiler.compile_regex(spec)  # type: ignore[attr-defined]
            elif kind == "choice":
                alts = " | ".join(json.dumps(c) for c in so.choice or ())
                cg = self._compiler.compile_grammar(f"root ::= {alts}")  # type: ignore[attr-defined]
            else:
                cg = self._compiler.compile_grammar(spec)  # type: ignore[attr-defined]
        except Exception as e:  # xgrammar raises RuntimeError / ValueError
            # drop xgrammar's "[12:00:00] /project/cpp/file.cc:123: " prefix
            why = re.sub(r"^\[[0-9:]+\] \S+?:\d+: ", "", str(e).splitlines()[0])
            raise StructuredOutputError(
                f"structured_outputs {kind} does not compile: {why[:300]}",
                param="structured_outputs",
            ) from e
        if kind in ("json", "json_object"):
            return Compiled(cg, self._control, self._ends_ed, self._after_ed)
        return Compiled(cg, [])


class Matchers:
    """The sampler's per-sequence grammar matchers."""

    def __init__(self) -> None:
        self._m: dict[str, tuple[object, int]] = {}

    def get(self, seq_id: str, compiled: Compiled, outputs: Sequence[int]) -> object:
        """The matcher of ``seq_id`` having accepted exactly ``outputs``."""
        import xgrammar as xgr

        held = self._m.get(seq_id)
        if held is not None and held[1] == len(outputs):
            return held[0]
        m = xgr.GrammarMatcher(compiled.grammar)  # type: ignore[arg-type]
        for t in outputs:
            if m.is_terminated():
                # past the grammar's end only ends follow (ignore_eos), which accepted() does
                # not feed to the matcher either (a finished matcher refuses a second end)
                break
            if not m.accept_token(int(t)):
                raise RuntimeError(f"output token {t} of {seq_id} violates its grammar")
        self._m[seq_id] = (m, len(outputs))
        return m

    def accepted(self, seq_id: str, token: int, ends: Sequence[int] = ()) -> bool:
        """Advance ``seq_id``'s matcher by ``token``. True when the sequence must end with it
        although its stop rules may not say so (``ignore_eos``): the grammar refused it and it
        is one of ``ends``, i.e. the sampler forced the end of a row that the grammar and the
        request's other rules (``allowed_token_ids``) left without a token. After a complete
        grammar the row's ends follow as before (``ignore_eos`` keeps them until max_tokens)."""
        m, n = self._m[seq_id]
        self._m[seq_id] = (m, n + 1)
        if m.is_terminated():  # type: ignore[attr-defined]
            return False
        if not m.accept_token(int(token)):  # type: ignore[attr-defined]
            if token in ends:
                return True
            raise RuntimeError(f"token {token} violates the grammar of {seq_id}")
        return False

    def drop(self, seq_ids) -> None:  # type: ignore[no-untyped-def]
        for s in seq_ids:
            self._m.pop(s, None)

"""Drive a workload against a server: arrivals, concurrency limit, warm-ups, chat history.

Sessions arrive by a Poisson process (or a gamma process with ``burstiness`` != 1, as in
vLLM) at ``request_rate`` per second, or all at once when the rate is infinite. A session's
turns run one after the other: turn k+1 is sent when turn k's answer has arrived (plus
``think_time``), with the whole history. ``max_concurrency`` caps requests in flight; a
session waiting for a slot holds none.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from bench.client import RequestRecord, build_payload, stream_request
from bench.datasets import Session, TextMaker, Turn
from bench.tokenizer import BenchTokenizer


class BenchRunError(RuntimeError):
    """The run could not go ahead (e.g. a warm-up request failed)."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str  # full endpoint URL
    backend: str  # "completions" or "chat"
    model_name: str  # the "model" field of each request
    headers: dict[str, str] = field(default_factory=dict)
    temperature: float | None = 0.0
    ignore_eos: bool = False
    extra_body: dict | None = None
    request_rate: float = math.inf  # sessions per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    request_timeout: float = 600.0  # seconds, whole request including the stream
    think_time: float = 0.0  # seconds between a session's turns
    seed: int = 0
    disable_tqdm: bool = False


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration: float  # seconds from the first dispatch to the last request's end
    skipped_turns: int  # turns not sent because an earlier turn of their session failed


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Start times (s) of ``n`` arrivals: the first at 0, then gamma-distributed gaps with
    mean ``1/rate`` and shape ``burstiness`` (1 = Poisson, < 1 burstier, > 1 more regular)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed + 1_000_003)  # apart from the dataset's stream
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1])))


def _messages(session: Session, history: list[dict[str, str]], user: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": session.system}] if session.system else []
    return msgs + history + [{"role": "user", "content": user}]


class Runner:
    """Runs one workload once; build a new one per run."""

    def __init__(self, cfg: LoadConfig, tok: BenchTokenizer):
        if cfg.backend not in ("completions", "chat"):
            raise ValueError(f"unknown backend {cfg.backend!r}")
        self.cfg = cfg
        self.tok = tok
        self._sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self._records: list[RequestRecord] = []
        self._skipped = 0
        self._pbar = None
        self._t0 = 0.0

    async def _one(
        self,
        http: aiohttp.ClientSession,
        session: Session,
        turn_no: int,
        history: list[dict[str, str]],
        index: int,
    ) -> RequestRecord:
        cfg = self.cfg
        turn = session.turns[turn_no]
        prompt: str | list[dict[str, str]]
        prompt = _messages(session, history, turn.prompt) if cfg.backend == "chat" else turn.prompt
        body = build_payload(
            cfg.backend,
            cfg.model_name,
            prompt,
            turn.output_len,
            cfg.temperature,
            cfg.ignore_eos,
            cfg.extra_body,
        )
        headers = dict(
            cfg.headers, **{"x-request-id": f"bench-{session.session_id}-{turn_no}-{index}"}
        )
        rec = RequestRecord(index, session.session_id, turn_no, turn.prompt_len, turn.output_len)
        if cfg.backend == "completions":
            rec.client_prompt_len = turn.prompt_len
        if self._sem is None:
            await stream_request(http, cfg.url, body, headers, rec, self._t0)
        else:
            async with self._sem:
                await stream_request(http, cfg.url, body, headers, rec, self._t0)
        if rec.success:
            if rec.output_tokens is None:  # no usage from the server: count it ourselves
                rec.output_tokens = self.tok.count(rec.text, add_special_tokens=False)
            if cfg.backend == "chat" and not rec.prompt_tokens_from_server:
                n = self.tok.count_chat(prompt)  # type: ignore[arg-type]
                rec.prompt_len = n if n is not None else rec.prompt_len
        return rec

    async def _session(
        self, http: aiohttp.ClientSession, session: Session, delay: float, counter: list[int]
    ) -> None:
        now = time.perf_counter() - self._t0
        if delay > now:
            await asyncio.sleep(delay - now)
        history: list[dict[str, str]] = []
        for k, turn in enumerate(session.turns):
            if k and self.cfg.think_time > 0:
                await asyncio.sleep(self.cfg.think_time)
            counter[0] += 1
            rec = await self._one(http, session, k, history, counter[0] - 1)
            self._records.append(rec)
            if self._pbar is not None:
                self._pbar.update(1)
            if not rec.success:
                left = len(session.turns) - k - 1
                self._skipped += left
                if self._pbar is not None and left:
                    self._pbar.update(left)
                return
            history += [
                {"role": "user", "content": turn.prompt},
                {"role": "assistant", "content": rec.text},
            ]

    def _http(self, pool: int) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=pool, limit_per_host=pool, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)

    def _warmup_sessions(self, sessions: list[Session], n: int) -> list[Session]:
        """``n`` one-turn sessions shaped like the first turns of ``sessions`` (prompt tokens,
        max_tokens) with prompts drawn from another seed: warm-ups that sent the timed prompts
        would leave them in the server's prefix cache and flatter the timed TTFT."""
        maker = TextMaker(self.tok, np.random.default_rng(self.cfg.seed + 2_000_003))
        out = []
        for i in range(n):
            s = sessions[i % len(sessions)]
            prompt, n_tokens = maker.fit(s.turns[0].prompt_len)
            out.append(Session(s.session_id, (Turn(prompt, n_tokens, s.turns[0].output_len),)))
        return out

    async def _warmup(self, http: aiohttp.ClientSession, sessions: list[Session]) -> None:
        n = self.cfg.num_warmups
        if n <= 0:
            return
        self._t0 = time.perf_counter()
        firsts = self._warmup_sessions(sessions, n)
        recs = await asyncio.gather(*(self._one(http, firsts[i], 0, [], i) for i in range(n)))
        failed = [r for r in recs if not r.success]
        if failed:
            raise BenchRunError(
                f"{len(failed)} of {n} warm-up requests failed; first error: {failed[0].error}"
            )

    async def run(self, sessions: list[Session]) -> RunResult:
        if not sessions:
            raise ValueError("no sessions to run")
        if self.cfg.backend == "completions" and any(len(s.turns) > 1 for s in sessions):
            raise ValueError("multi-turn sessions need the chat backend")
        cfg = self.cfg
        total_turns = sum(len(s.turns) for s in sessions)
        pool = cfg.max_concurrency or len(sessions)
        offsets = arrival_offsets(len(sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
        async with self._http(pool) as http:
            await self._warmup(http, sessions)
            if not cfg.disable_tqdm:
                from tqdm import tqdm

                self._pbar = tqdm(total=total_turns, unit="req", dynamic_ncols=True)
            counter = [0]
            self._t0 = time.perf_counter()
            try:
                tasks = []
                for s, off in zip(sessions, offsets.tolist(), strict=True):
                    now = time.perf_counter() - self._t0
                    if off > now:  # pace task creation so sleeping tasks don't pile up
                        await asyncio.sleep(off - now)
                    tasks.append(asyncio.create_task(self._session(http, s, off, counter)))
                await asyncio.gather(*tasks)
            finally:
                if self._pbar is not None:
                    self._pbar.close()
        duration = max((r.end for r in self._records), default=0.0)
        self._records.sort(key=lambda r: r.index)
        return RunResult(self._records, duration, self._skipped)

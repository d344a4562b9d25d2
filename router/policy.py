"""Routing policy: pick the (prefill, decode) pair of lowest estimated cost. Pure logic.

Costs are in prompt-token equivalents of prefill compute (``docs/notes/router.md``):

- prefill on P: the prompt tokens P has not cached (``N - cached_P``);
- transfer to D: ``transfer_cost`` per prompt token D lacks (``N - cached_D``), the blocks
  P must push over UCX;
- local prefill on D: ``local_prefill_penalty`` per token D lacks, raised by
  ``decode_stall_cost`` for each request D is already decoding for this router (a prefill
  chunk on D stalls every sequence in its decode batch);
- prefill backlog: the prompt tokens this router has sent to a worker to prefill (on P, or
  locally on D) whose first token has not come back yet: compute queued ahead of this
  request. Under a burst this splits the prefills between P and D instead of queueing them
  all on P while D idles, and it shifts them back to P once D is decoding;
- load: ``prefill_queue_cost`` per request P reports queued or running (reports lag up to
  a heartbeat plus a refresh, ~1.5 s, so the prefills this router saw leave P since the
  report are taken off: ``WorkerPool.reported_queue``; the larger of that and the backlog
  counts), ``decode_waiting_cost`` per request
  waiting on D, ``decode_running_cost`` per request D is decoding (D's reports corrected the
  same way for the streams this router saw end), plus
  ``decode_waiting_cost`` when D lacks the free KV blocks for the prompt (it would queue or
  preempt).

Conditional disaggregation: when D lacks at most ``local_prefill_threshold`` tokens, or no
prefill worker is healthy, the only option for D is a local prefill (no P).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

PATH_DISAGG = "disagg"
PATH_LOCAL = "local"


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    local_prefill_threshold: int = 128
    transfer_cost: float = 0.25
    local_prefill_penalty: float = 2.0
    idle_local_prefill_tokens: int = 1024
    prefill_queue_cost: float = 512.0
    decode_waiting_cost: float = 512.0
    decode_running_cost: float = 16.0
    decode_stall_cost: float = 0.125


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy worker as the policy sees it."""

    worker_id: str
    address: str
    cached_tokens: int  # leading prompt tokens in its prefix cache (full blocks only)
    running: int
    waiting: int
    free_blocks: int
    block_size: int
    inflight: int = 0  # requests this router sent it and has not seen finish
    prefill_backlog: int = 0  # prompt tokens this router sent it to prefill, no first token yet
    decoding: int = 0  # requests this router is streaming from it past their first token
    weights: str = ""  # the weight scheme it advertises ("" dense): P and D must agree


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode: Candidate
    prefill: Candidate | None
    cost: float
    uncached_tokens: int  # prompt tokens D lacks (transferred, or prefilled locally)

    @property
    def path(self) -> str:
        return PATH_LOCAL if self.prefill is None else PATH_DISAGG


def _uncached(prompt_len: int, cached: int) -> int:
    # even a full hit recomputes the last token (the engine needs its logits)
    return max(1, prompt_len - cached)


def decode_load(c: Candidate, prompt_len: int, cfg: PolicyConfig) -> float:
    """Queue and KV pressure on a decode worker, in token equivalents."""
    # requests sent here since the last load report count as running (the report lags ~1 s)
    unreported = max(0, c.inflight - c.running - c.waiting)
    cost = cfg.decode_running_cost * (c.running + unreported) + cfg.decode_waiting_cost * c.waiting
    needed = -(-_uncached(prompt_len, c.cached_tokens) // c.block_size)
    if c.free_blocks < needed:
        cost += cfg.decode_waiting_cost
    return cost


def prefill_load(c: Candidate, cfg: PolicyConfig) -> float:
    """Work queued on a prefill worker ahead of a new request, in tokens."""
    return max(float(c.prefill_backlog), cfg.prefill_queue_cost * (c.running + c.waiting))


def idle(d: Candidate) -> bool:
    """Nothing on ``d``: nothing this router sent it is in flight, and its last report had
    nothing running or waiting (another router's work shows there, ~1 s late)."""
    return (
        d.inflight == 0
        and d.prefill_backlog == 0
        and d.decoding == 0
        and d.running == 0
        and d.waiting == 0
    )


def local_prefill_cost(d: Candidate, lacking: int, cfg: PolicyConfig) -> float:
    """Prefilling ``lacking`` tokens on decode worker ``d``: its own prefill backlog (work
    ahead of this prompt) plus the tokens, weighted by the stall they cause to the sequences
    it is decoding. On an idle ``d``, up to ``idle_local_prefill_tokens``, a token costs what
    it costs on P (there is no batch to stall, and no transfer); a longer prompt would hold
    back the decoding of what arrives while it runs, and keeps the penalty."""
    if idle(d) and lacking <= cfg.idle_local_prefill_tokens:
        return float(lacking)
    return (
        d.prefill_backlog
        + cfg.local_prefill_penalty * (1.0 + cfg.decode_stall_cost * d.decoding) * lacking
    )


def choose_route(
    prompt_len: int,
    decode: Sequence[Candidate],
    prefill: Sequence[Candidate],
    cfg: PolicyConfig,
    rng: random.Random | None = None,
) -> RouteDecision | None:
    """The cheapest option; ``None`` when there is no decode candidate. Ties break at random."""
    if prompt_len <= 0:
        raise ValueError("prompt_len must be positive")
    options: list[RouteDecision] = []
    p_costs = [(p, _uncached(prompt_len, p.cached_tokens) + prefill_load(p, cfg)) for p in prefill]
    for d in decode:
        lacking = _uncached(prompt_len, d.cached_tokens)
        d_load = decode_load(d, prompt_len, cfg)
        options.append(
            RouteDecision(d, None, local_prefill_cost(d, lacking, cfg) + d_load, lacking)
        )
        if lacking <= cfg.local_prefill_threshold:
            continue  # D holds nearly all of the prompt: conditional disaggregation says local
        for p, p_cost in p_costs:
            if p.block_size != d.block_size:
                continue  # KV blocks of another geometry cannot be pushed into D's pool
            if p.weights != d.weights:
                continue  # KV computed by other weights is not the KV D's model would make
            cost = p_cost + cfg.transfer_cost * lacking + d_load
            options.append(RouteDecision(d, p, cost, lacking))
    if not options:
        return None
    best = min(o.cost for o in options)
    ties = [o for o in options if o.cost <= best + 1e-9]
    return ties[0] if len(ties) == 1 else (rng or random).choice(ties)

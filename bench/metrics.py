"""Aggregate request records into serving metrics, defined as ``vllm bench serve`` does.

* TTFT, E2E latency: per successful request.
* TPOT = (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token.
* ITL: every gap between consecutive content events, pooled over all requests.
* Throughput: successful requests, output tokens and (prompt + output) tokens per second of
  benchmark duration. Token counts come from the server's usage event when it sent one.
* Goodput: successful requests per second whose TTFT/TPOT/E2E all meet the SLOs (ms); TPOT
  counts as 0 for single-token outputs, as in vLLM.
Percentiles are ``numpy.percentile`` (linear interpolation); latencies are reported in ms.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from bench.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
DEFAULT_PERCENTILES = "50,90,99"


class MetricsError(ValueError):
    """Bad metric, percentile or SLO specification."""


def parse_percentile_metrics(spec: str) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise MetricsError(f"--percentile-metrics: unknown {bad or spec!r}; choose from {METRICS}")
    return names


def parse_percentiles(spec: str) -> list[float]:
    try:
        ps = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError as e:
        raise MetricsError(f"--metric-percentiles: not a number list: {spec!r}") from e
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise MetricsError(f"--metric-percentiles: values must be in [0, 100], got {spec!r}")
    return ps


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise MetricsError(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise MetricsError(f"--goodput: {item!r} has no number after the colon") from e
        if slos[name] <= 0:
            raise MetricsError(f"--goodput: SLO must be > 0 ms, got {item!r}")
    return slos


def _tpot(r: RequestRecord) -> float | None:
    n = r.output_tokens or 0
    return (r.latency - r.ttft) / (n - 1) if n > 1 else None


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once, from their start and end times."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    peak = cur = 0
    for _, d in events:  # ends sort before starts at equal times
        cur += d
        peak = max(peak, cur)
    return peak


def _stats(values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """Mean, median, std and percentiles in ms; all None when there are no values."""
    keys = ["mean", "median", "std"] + [f"p{p:g}" for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
    }
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def compute_metrics(
    records: list[RequestRecord],
    duration: float,
    percentiles: list[float],
    metrics: list[str],
    slos: dict[str, float] | None = None,
    skipped_turns: int = 0,
) -> dict:
    """The summary dict saved to JSON and printed; latencies in ms, rates per second."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    dur = duration if duration > 0 else float("inf")  # rates become 0, never NaN
    in_tokens = sum(r.prompt_len for r in ok)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in map(_tpot, ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    result: dict = {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "skipped_turns": skipped_turns,
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "peak_concurrency": peak_concurrency(records),
        # Completions prompts whose server-side count differs from ours: a sign that --model
        # (or --tokenizer) is not the tokenizer the server uses.
        "prompt_len_mismatches": sum(
            r.prompt_tokens_from_server
            and r.client_prompt_len is not None
            and r.prompt_len != r.client_prompt_len
            for r in ok
        ),
        "usage_from_server": {
            "prompt": sum(r.prompt_tokens_from_server for r in ok),
            "output": sum(r.output_tokens_from_server for r in ok),
            "of": len(ok),
        },
    }
    for m in metrics:
        result[m] = _stats(values[m], percentiles)
    if slos:
        good = 0
        for r in ok:
            checks = {"ttft": r.ttft, "tpot": _tpot(r) or 0.0, "e2el": r.latency}
            good += all(checks[k] * 1000.0 <= v for k, v in slos.items())
        result["goodput"] = {
            "slo_ms": dict(slos),
            "good_requests": good,
            "request_goodput": good / dur,
        }
    return result

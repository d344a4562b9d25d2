"""Human and machine output: the summary table, the JSON file and the sweep plot."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.client import RequestRecord

_NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_W = 56


def _line(label: str, value: object) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40}{text:>{_W - 40}}"


def format_summary(title: str, m: dict, metrics: list[str], percentiles: list[float]) -> str:
    """The printed table, one metric per line (``vllm bench serve``'s layout, our labels)."""
    rows = [
        f" {title} ".center(_W, "="),
        _line("Successful requests:", m["completed"]),
        _line("Failed requests:", m["failed"]),
    ]
    if m.get("skipped_turns"):
        rows.append(_line("Skipped turns (session failed earlier):", m["skipped_turns"]))
    rows += [
        _line("Benchmark duration (s):", m["duration_s"]),
        _line("Total input tokens:", m["total_input_tokens"]),
        _line("Total generated tokens:", m["total_output_tokens"]),
        _line("Request throughput (req/s):", m["request_throughput"]),
        _line("Output token throughput (tok/s):", m["output_throughput"]),
        _line("Total token throughput (tok/s):", m["total_token_throughput"]),
        _line("Peak concurrent requests:", m["peak_concurrency"]),
    ]
    if "goodput" in m:
        slo = " ".join(f"{k}:{v:g}" for k, v in m["goodput"]["slo_ms"].items())
        rows.append(_line(f"Request goodput (req/s) [{slo}]:", m["goodput"]["request_goodput"]))
    if m.get("prompt_len_mismatches"):
        rows.append(_line("Prompts the server counted differently:", m["prompt_len_mismatches"]))
    u = m["usage_from_server"]
    if m["completed"] and u["output"] < u["of"]:
        rows.append(_line("Output counts re-tokenized (no usage):", u["of"] - u["output"]))
    for name in metrics:
        long, short = _NAMES[name]
        s = m[name]
        rows.append(f" {long} ".center(_W, "-"))
        rows.append(_line(f"Mean {short} (ms):", s["mean"]))
        if 50.0 not in percentiles:
            rows.append(_line(f"Median {short} (ms):", s["median"]))
        for p in percentiles:
            rows.append(_line(f"P{p:g} {short} (ms):", s[f"p{p:g}"]))
    if m["errors"]:
        rows.append(" Errors ".center(_W, "-"))
        for i, (err, n) in enumerate(m["errors"].items()):
            if i == 5:
                rows.append(f"... and {len(m['errors']) - 5} more distinct errors (see the JSON)")
                break
            rows.append(f"{n:>5} x {err[:200]}")
    rows.append("=" * _W)
    return "\n".join(rows)


def record_dict(r: RequestRecord, with_text: bool) -> dict:
    d = asdict(r)
    if not with_text:
        d.pop("text")
    return d


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` (infinite floats become the string "inf") and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=1) + "\n")
    return path


def _finite(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def plot_sweep(points: list[tuple[float, dict]], path: Path, title: str) -> Path:
    """PNG of output throughput (x) against p99 TTFT (left) and p99 ITL/TPOT (right), one
    marker per request rate, labelled with the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [m["output_throughput"] for _, m in points]
    series = [
        (ax1, "ttft", "TTFT p99", "tab:blue", "o"),
        (ax2, "itl", "ITL p99", "tab:orange", "s"),
        (ax2, "tpot", "TPOT p99", "tab:green", "^"),
    ]
    for ax, key, label, color, marker in series:
        y = [m[key]["p99"] if m[key]["p99"] is not None else math.nan for _, m in points]
        ax.plot(x, y, marker=marker, color=color, label=label)
        if key != "tpot":
            for (rate, _), xi, yi in zip(points, x, y, strict=True):
                ax.annotate(
                    f"rate {rate_label(rate)}",
                    (xi, yi),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    for ax, ylabel in ((ax1, "p99 TTFT (ms)"), (ax2, "p99 latency (ms)")):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

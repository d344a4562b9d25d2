"""``bench/plot_compare.py``: the subtitle names the topology and its real thread layout."""

from __future__ import annotations

import json

import pytest

from bench.plot_compare import main, pdserve_threads

_THREADS = {
    "vllm": {"config": "A"},
    "pdserve-colocated-1D": {
        "workers": 1,
        "CPU binding": "(PDSERVE_CPU_OMP_THREADS_BIND=auto): decode-0 on CPU 0; router on CPU 1",
        "torch threads:": "1 on CPU 0 for steps of at most 256 tokens, 2 on CPU 0-1 for "
        "longer ones (PDSERVE_CPU_SPILL_BIND; PDSERVE_SMALL_STEP_TOKENS sets the size)",
    },
    "pdserve-1P1D": {
        "workers": 2,
        "CPU binding": "(PDSERVE_CPU_OMP_THREADS_BIND=auto): prefill-0 on CPU 0, decode-0 on "
        "CPU 1; router and Redis on any CPU (PDSERVE_CPU_OMP_THREADS_BIND=nobind turns it off)",
    },
    "pdserve-colocated-1D-2t": {"workers": 1, "--threads-per-worker": 2},
}


def test_threads_from_what_pdserve_up_logged():
    # what a run with the default (automatic) binding records: no explicit thread count
    assert pdserve_threads({"threads": _THREADS}, "pdserve-colocated-1D") == (
        "pdserve-colocated-1D",
        "torch threads: 1 on CPU 0 for steps of at most 256 tokens, 2 on CPU 0-1 for longer ones",
    )
    assert pdserve_threads({"threads": _THREADS}, "pdserve-1P1D") == (
        "pdserve-1P1D",
        "prefill-0 on CPU 0, decode-0 on CPU 1",
    )
    assert pdserve_threads({"threads": _THREADS}, "pdserve-colocated-1D-2t")[1] == (
        "2 torch thread(s)/worker"
    )
    # no system named: the first pdserve one
    assert pdserve_threads({"threads": _THREADS})[0] == "pdserve-colocated-1D"
    # older summaries kept one "pdserve" record with the count
    old = {"threads": {"pdserve": {"torch_threads_per_worker": 1}}}
    assert pdserve_threads(old) == ("pdserve", "1 torch thread(s)/worker")
    assert pdserve_threads({}) == ("pdserve", "thread layout not recorded")


def test_main_plots_every_topology(tmp_path):
    pytest.importorskip("matplotlib")
    ratio = {"output_throughput": {"ratio": {"mean": 1.2, "lo": 1.1, "hi": 1.3}}}
    summary = {
        "tag": "t",
        "threads": _THREADS,
        "ratios": {"r256_n64": ratio},
        "ratios_by_topology": {
            "pdserve-colocated-1D": {"r256_n64": ratio},
            "pdserve-1P1D": {"r256_n64": ratio},
        },
    }
    src = tmp_path / "compare_t.json"
    src.write_text(json.dumps(summary))
    assert main([str(src)]) == 0
    assert (tmp_path / "compare_t.png").stat().st_size > 0
    assert (tmp_path / "compare_t_pdserve-1P1D.png").stat().st_size > 0

"""The worker's engine-step metrics: every step that scheduled tokens reports its duration and
its token count (``pdserve:engine_step_seconds``, ``pdserve:iteration_tokens_total``), before
its outputs reach the streams."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import generate_latest

from shared.engine import EngineStats
from shared.engine.sampling_params import SamplingParams
from shared.worker.engine_loop import EngineLoop
from shared.worker.metrics import WorkerMetrics
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit


def test_each_step_reports_its_time_and_tokens_before_its_outputs(tmp_path):
    # a 20-token prompt in chunks of at most 8 tokens, then 5 one-token decode steps
    e = fake_engine(tmp_path, max_num_batched_tokens=8, max_model_len=64)
    steps: list[tuple[float, int]] = []
    seen_at_output: list[int] = []
    done = threading.Event()

    def sink(o):
        seen_at_output.append(len(steps))
        if o.finished:
            done.set()

    loop = EngineLoop(e, on_step_time=lambda dt, n: steps.append((dt, n)))
    loop.add_sink("r", sink)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        loop.submit(lambda eng: eng.add_request("r", list(range(5, 25)), params)).result(5)
        assert done.wait(10)
    finally:
        loop.stop()
    assert [n for _, n in steps] == [8, 8, 4, 1, 1, 1, 1, 1]
    assert all(dt > 0 for dt, _ in steps)
    # the first token comes with the third step, and each output after its step's report
    assert seen_at_output == [3, 4, 5, 6, 7, 8]


def test_worker_metrics_expose_the_step_histograms():
    idle = EngineStats(16, 16, 16, 0, 0, 0.0, 0.0, 0, 0, 0, 0)
    m = WorkerMetrics("decode", "decode-0", "tiny", lambda: idle)
    for dt, n in ((0.004, 1), (0.012, 16), (0.180, 2048)):
        m.observe_step(dt, n)
    text = generate_latest(m.registry).decode()
    labels = 'model_name="tiny",role="decode",worker_id="decode-0"'

    def sample(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name) and labels in ln)
        return float(line.split()[-1])

    assert sample("pdserve:engine_step_seconds_count{") == 3
    assert sample("pdserve:engine_step_seconds_sum{") == pytest.approx(0.196)
    assert sample('pdserve:engine_step_seconds_bucket{le="0.005",') == 1
    assert sample("pdserve:iteration_tokens_total_sum{") == 2065
    assert sample('pdserve:iteration_tokens_total_bucket{le="16.0",') == 2
    assert sample('pdserve:iteration_tokens_total_bucket{le="1024.0",') == 2

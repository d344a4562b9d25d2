"""The engine thread gives the CPU up once after each step whose outputs went out (so the
event loop it just woke streams them at once on a shared core), and not after steps with none;
``PDSERVE_ENGINE_YIELD=0`` turns it off."""

from __future__ import annotations

import threading

import pytest

from shared.engine.sampling_params import SamplingParams
from shared.worker import engine_loop
from shared.worker.engine_loop import EngineLoop
from tests.engine.fakes import fake_engine

pytestmark = pytest.mark.unit


def _run(tmp_path, monkeypatch, **loop_args) -> list[str]:
    """Events in order: "out" for each output delivered, "yield" for each sched_yield."""
    # a 20-token prompt in chunks of at most 8 (two steps without outputs), then 6 tokens
    e = fake_engine(tmp_path, max_num_batched_tokens=8, max_model_len=64)
    events: list[str] = []
    done = threading.Event()
    monkeypatch.setattr(engine_loop.os, "sched_yield", lambda: events.append("yield"))

    def sink(o):
        events.append("out")
        if o.finished:
            done.set()

    loop = EngineLoop(e, **loop_args)
    loop.add_sink("r", sink)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        loop.submit(lambda eng: eng.add_request("r", list(range(5, 25)), params)).result(5)
        assert done.wait(10)
    finally:
        loop.stop()
    return events


def test_one_yield_after_each_step_with_outputs_and_after_its_delivery(tmp_path, monkeypatch):
    monkeypatch.delenv(engine_loop.YIELD_ENV, raising=False)
    events = _run(tmp_path, monkeypatch)
    assert events == ["out", "yield"] * 6


def test_off_by_environment_or_argument(tmp_path, monkeypatch):
    monkeypatch.setenv(engine_loop.YIELD_ENV, "0")
    assert _run(tmp_path, monkeypatch) == ["out"] * 6
    monkeypatch.delenv(engine_loop.YIELD_ENV)
    assert _run(tmp_path / "b", monkeypatch, yield_after_outputs=False) == ["out"] * 6

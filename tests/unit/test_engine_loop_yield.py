"""The engine thread gives the CPU up once after each step whose outputs went out (so the
event loop it just woke streams them at once on a shared core), and after commands that
delivered outputs (a remote prefill's first token), and not after steps with none;
``PDSERVE_ENGINE_YIELD=0`` turns it off."""

from __future__ import annotations

import threading

import pytest

from shared.engine.outputs import EngineCoreOutput
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


def test_one_yield_after_a_command_that_delivered_outputs(tmp_path, monkeypatch):
    """A decode worker hands a remote prefill's first token out from a command
    (``finish_remote_prefill``), not from a step; it streamed one decode step late on a shared
    core (1P + 1D's TTFT at concurrency 1) until the loop yielded after such commands too."""
    monkeypatch.delenv(engine_loop.YIELD_ENV, raising=False)
    events: list[str] = []
    yielded = threading.Event()

    def fake_yield():
        events.append("yield")
        yielded.set()

    monkeypatch.setattr(engine_loop.os, "sched_yield", fake_yield)
    loop = EngineLoop(fake_engine(tmp_path, max_model_len=64))
    loop.add_sink("r", lambda o: events.append("out"))
    loop.start()
    try:
        loop.submit(lambda e: None).result(5)  # a command without outputs: no yield
        first = EngineCoreOutput("r", 0, [7], [])
        loop.submit(lambda e: loop.deliver([first])).result(5)
        assert yielded.wait(5)
        loop.submit(lambda e: None).result(5)
    finally:
        loop.stop()
    assert events == ["out", "yield"]

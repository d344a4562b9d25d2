"""A worker without ``--redis-url`` has no publisher: its KV events were still queued for one
every step, so the queue grew with every block stored or evicted for the life of the process."""

from __future__ import annotations

import time

import pytest

from shared.engine.sampling_params import SamplingParams
from tests.services.inprocess_worker import standalone_runtime

pytestmark = pytest.mark.integration


def test_without_a_registry_no_kv_event_is_kept(tiny_llama):
    rt = standalone_runtime(tiny_llama, "decode")
    assert not rt.args.redis_url
    made: list[int] = []
    take = rt.engine.take_kv_events

    def counted():
        events = take()
        made.append(len(events))
        return events

    rt.engine.take_kv_events = counted  # type: ignore[method-assign]
    rt.loop.start()
    try:
        sp = SamplingParams(max_tokens=2, temperature=0)
        for i in range(4):
            prompt = [(i * 7 + j) % 90 + 3 for j in range(64)]  # 4 full blocks each
            rt.loop.submit(lambda e, i=i, p=prompt: e.add_request(f"r{i}", p, sp)).result(10)
        deadline = time.monotonic() + 30
        while rt.loop.submit(lambda e: e.has_unfinished_requests()).result(10):
            assert time.monotonic() < deadline, "requests did not finish"
            time.sleep(0.02)
        assert sum(made) >= 4  # the four prompts stored their blocks: events were made
        assert rt._events.qsize() == 0
    finally:
        rt.loop.stop()

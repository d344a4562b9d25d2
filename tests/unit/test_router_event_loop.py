"""What keeps the router's event loop answering (/health, other clients' tokens) while one
request is large: each found with ``tests/router/test_router_input.py``'s /health probe.

- a finished request leaves no reference cycle: the disconnect watcher's cancelled task kept
  the watcher, and through ``on_gone`` the whole generation, until a full collection (70-90 ms
  on the loop for a 128-prompt request);
- a long list of chat messages is validated a slice per loop turn, with the same result and
  the same error as one validation;
- a flat list of token ids skips the union's ``list[str]`` attempt (an error per item), with
  the same result as the plain union for every prompt shape.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter, ValidationError

from router.body import PREVALIDATE_SLICE, JSONBodyRoute, model_list_fields, prevalidate_lists
from router.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from router.sse import DisconnectWatch

pytestmark = pytest.mark.unit


class _Generation:
    def client_left(self) -> bool:
        return False


def test_a_stopped_disconnect_watch_is_freed_without_the_cycle_collector():
    async def main() -> weakref.ref[Any]:
        async def receive() -> dict[str, str]:
            await asyncio.Event().wait()  # the client never disconnects
            return {"type": "http.disconnect"}

        gen = _Generation()
        watch = DisconnectWatch(receive, on_gone=gen.client_left)
        await asyncio.sleep(0)  # the watcher awaits receive()
        ref = weakref.ref(gen)
        watch.stop()
        for _ in range(3):
            await asyncio.sleep(0)  # the watcher's cancellation is delivered
        del watch, gen
        return ref

    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        gen_ref = asyncio.run(main())
        # freed by reference counting alone: nothing left for a full collection to find
        assert gen_ref() is None
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, DisconnectWatch)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


def test_long_message_lists_are_validated_a_slice_per_loop_turn():
    n = 5 * PREVALIDATE_SLICE + 7
    body = {"model": "m", "messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]}
    fields = model_list_fields(ChatCompletionRequest)
    assert set(fields) == {"messages"}
    turns = 0

    async def main() -> None:
        nonlocal turns
        stop = False

        async def count() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await asyncio.sleep(0)
        await prevalidate_lists(body, fields)
        stop = True
        await counter

    asyncio.run(main())
    # the other task ran between the slices (6 slices: at least 5 turns)
    assert turns >= n // PREVALIDATE_SLICE
    assert all(isinstance(m, ChatMessage) for m in body["messages"])
    direct = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": f"m{i}"} for i in range(n)]}
    )
    assert ChatCompletionRequest.model_validate(body) == direct


def test_an_invalid_message_in_a_long_list_gives_the_same_error_as_before():
    app = FastAPI()
    app.router.route_class = JSONBodyRoute

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, int]:
        return {"messages": len(body.messages)}

    n = 3 * PREVALIDATE_SLICE
    good = [{"role": "user", "content": "hi"}] * n
    bad = list(good)
    bad[2 * PREVALIDATE_SLICE + 3] = {"role": 7, "content": "hi"}
    with TestClient(app) as client:
        ok = client.post("/chat", json={"messages": good})
        assert ok.status_code == 200 and ok.json() == {"messages": n}
        r = client.post("/chat", json={"messages": bad})
    assert r.status_code == 422
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "messages", 2 * PREVALIDATE_SLICE + 3, "role"]
    with pytest.raises(ValidationError) as direct:
        ChatCompletionRequest.model_validate({"messages": bad})
    assert direct.value.errors()[0]["type"] == err["type"]


_UNION: TypeAdapter[Any] = TypeAdapter(str | list[str] | list[int] | list[list[int]] | None)


@pytest.mark.parametrize(
    "prompt",
    [
        [1, 2, 3],
        list(range(5000)),
        [1, 2.0],
        [1, "2"],
        ["a", "b"],
        [[1, 2], [3]],
        [True, 1],
        "text",
        None,
        [],
        [1, [2]],
        [1, None],
    ],
)
def test_the_token_id_fast_path_gives_the_unions_result(prompt):
    try:
        want: Any = ("ok", _UNION.validate_python(prompt))
    except ValidationError:
        want = ("error", None)
    try:
        got: Any = ("ok", CompletionRequest.model_validate({"prompt": prompt}).prompt)
    except ValidationError:
        got = ("error", None)
    assert got == want
    if want[0] == "ok":
        assert type(got[1]) is type(want[1])

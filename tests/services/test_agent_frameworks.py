"""The agent frameworks people put in front of an OpenAI-compatible server, unchanged, against
the router (one decode worker; ``--enable-auto-tool-choice --tool-call-parser hermes``):
LangChain's ``with_structured_output`` (JSON schema and function calling) and ``bind_tools``
(invoke and stream), instructor (tools and JSON-schema modes). With random weights the output
parses only because the grammar forces it, which is the point of these tests."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.cluster_utils import make_cluster

pytestmark = pytest.mark.integration


class Person(BaseModel):
    """A person."""

    name: Literal["ann", "bob", "cy"]
    age: int = Field(ge=0, le=99)
    admin: bool


class GetWeather(BaseModel):
    """Get the weather of a city."""

    city: Literal["paris", "oslo", "lima"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("agents"), prefill=0)
    c.start_redis()
    workers = [c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    url = c.start_router(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield c, url
    c.stop()


@pytest.fixture(scope="module")
def chat_model(cluster):
    from langchain_openai import ChatOpenAI

    c, url = cluster
    return ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="x",
        model=c.served_model_name,
        temperature=1.0,
        max_tokens=160,
        max_retries=0,
        timeout=120,
        seed=3,
    )


def _assert_person_json(fields: dict, parsed: Person) -> None:
    """The model's own JSON has the schema's types (pydantic's lax mode would also take
    ``"42"`` or ``"true"``, so ``isinstance`` alone misses a grammar that emits strings), and
    the parsed object is what it says."""
    assert {"name", "age", "admin"} <= set(fields), fields
    assert type(fields["age"]) is int and type(fields["admin"]) is bool, fields
    assert Person(**fields).model_dump() == parsed.model_dump(), (fields, parsed)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(Person, method=method, include_raw=True)
    for i in range(3):
        res = structured.invoke(f"Describe person {i}.")
        out, raw = res["parsed"], res["raw"]
        assert res["parsing_error"] is None and isinstance(out, Person), res
        fields = json.loads(raw.content) if method == "json_schema" else raw.tool_calls[0]["args"]
        _assert_person_json(fields, out)


def test_langchain_bind_tools_invoke_and_stream(chat_model):
    from langchain_core.messages import ToolMessage

    tooled = chat_model.bind_tools([GetWeather], tool_choice="any")  # "any": required
    msg = tooled.invoke("What is the weather in the north?")
    assert [tc["name"] for tc in msg.tool_calls][:1] == ["GetWeather"]
    GetWeather(**msg.tool_calls[0]["args"])
    assert not msg.invalid_tool_calls or len(msg.tool_calls) >= 1
    # streamed: the chunks add up to tool calls LangChain parses
    total = None
    for chunk in tooled.stream("And in the south?"):
        total = chunk if total is None else total + chunk
    assert total is not None and total.tool_calls
    GetWeather(**total.tool_calls[0]["args"])
    # the tool's answer goes back in and the model answers in text
    answer = chat_model.bind_tools([GetWeather], tool_choice="none").invoke(
        [
            ("human", "What is the weather in the north?"),
            msg,
            *(ToolMessage(content="sunny", tool_call_id=tc["id"]) for tc in msg.tool_calls),
        ]
    )
    assert isinstance(answer.content, str) and answer.content


def test_langchain_named_tool_choice(chat_model):
    tooled = chat_model.bind_tools([GetWeather, Person], tool_choice="Person")
    msg = tooled.invoke("Who is it?")
    assert [tc["name"] for tc in msg.tool_calls] == ["Person"]
    Person(**msg.tool_calls[0]["args"])


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(cluster, mode):
    import instructor
    import openai

    c, url = cluster
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120),
        mode=getattr(instructor.Mode, mode),
    )
    for seed in range(3):
        person, completion = client.chat.completions.create_with_completion(
            model=c.served_model_name,
            response_model=Person,
            messages=[{"role": "user", "content": f"Describe person {seed}."}],
            temperature=1.0,
            seed=seed,
            max_tokens=160,
            max_retries=0,  # no re-asking: the first answer must validate
        )
        assert isinstance(person, Person)
        msg = completion.choices[0].message
        raw = msg.tool_calls[0].function.arguments if mode == "TOOLS" else msg.content
        _assert_person_json(json.loads(raw), person)

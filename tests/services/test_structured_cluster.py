"""Structured outputs through the whole cluster: the ``openai`` SDK's ``chat.completions.parse``
with a pydantic model gets parsed objects back, the first token sampled on the prefill worker
and the rest on the decode worker under the same grammar; ``response_format`` json_object,
vLLM's ``structured_outputs`` extra and a bad schema (400 naming the field)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.cluster_utils import make_cluster

pytestmark = pytest.mark.integration


class Person(BaseModel):
    name: Literal["ann", "bob", "cy"]
    age: int = Field(ge=0, le=99)
    admin: bool


@pytest.fixture(scope="module")
def cluster_url(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("so"))
    c.start_redis()
    workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    url = c.start_router(["--local-prefill-threshold", "0"])  # every prompt via the prefill worker
    yield c, url
    c.stop()


def test_openai_sdk_parse_returns_pydantic_objects(cluster_url):
    import openai

    c, url = cluster_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for i in range(8):
        completion = client.chat.completions.parse(
            model=c.served_model_name,
            messages=[{"role": "user", "content": f"Describe person number {i}."}],
            response_format=Person,
            temperature=1.0,
            seed=i,
            max_tokens=120,
        )
        msg = completion.choices[0].message
        assert isinstance(msg.parsed, Person), msg.content
        # the content itself has the schema's types (pydantic's lax mode would take "42" or
        # "true" too), and exactly its fields (the strict schema has no additional properties)
        fields = json.loads(msg.content)
        assert set(fields) == {"name", "age", "admin"}, fields
        assert type(fields["age"]) is int and type(fields["admin"]) is bool, fields
        assert Person(**fields) == msg.parsed


def test_json_object_and_structured_outputs_extra(cluster_url):
    import httpx

    c, url = cluster_url
    body = {
        "model": c.served_model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": 3,
    }
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={**body, "structured_outputs": {"choice": ["red", "green"]}},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("red", "green")
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": c.served_model_name, "prompt": "x", "max_tokens": 20,
              "structured_outputs": {"regex": "[0-9]{4}"}},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            **body,
            "max_tokens": 300,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
        timeout=60,
    )
    text = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "response_format": bad}, timeout=60)
    assert r.status_code == 400, r.text
    assert "structured_outputs" in r.text or "response_format" in r.text
    both = {**body, "response_format": {"type": "json_object"}, "guided_regex": "a+"}
    r = httpx.post(f"{url}/v1/chat/completions", json=both, timeout=60)
    assert r.status_code == 400 and "both constrain" in r.text

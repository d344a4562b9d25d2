"""``pdserve fuzz``: throw malformed and hostile requests at a running cluster and check that
nothing a client (or a gRPC caller) sends takes a worker down.

    pdserve up --decode 2 --run-dir /tmp/run &          # or any cluster that wrote ready files
    pdserve fuzz --url http://127.0.0.1:8000 --run-dir /tmp/run --model-dir DIR \\
        --requests 2000 --grpc-requests 1000 --seed 1

About half the requests start from a valid OpenAI body (completions or chat, streaming or
not) and get one to four valid but unusual settings (extreme sampling values, the largest
allowed seeds with n > 1, logprobs, stop strings and ids, prompts at the context limit, tool
calls in the history), so the engine's paths run; the other half get one to three hostile
mutations: a field set to a hostile value (wrong type, 2^63 and 2^64, negative, NaN /
infinity, huge lists, lone surrogates, deep nesting, out-of-vocabulary token ids), a raw-body
mutation (invalid UTF-8, truncated JSON, NaN literals, 100k-deep brackets), or a header
mutation (content type, a client X-Request-Id shared by concurrent requests). The gRPC part
sends mutated ``Generate`` / ``Prefill`` calls straight to the workers.

Properties, checked per response and at the end:
  * no 5xx other than a 503 whose body is OpenAI-style JSON; no connection reset or hang;
    every 4xx has an OpenAI-style JSON body; a 200 stream ends with ``data: [DONE]``; a body
    holding NaN or Infinity (not JSON numbers) is never accepted;
  * gRPC calls end with a status from the allowed set (never UNKNOWN / INTERNAL / a hang);
  * every worker process is alive, SERVING, its ``check_integrity()`` passes, and once idle it
    holds no block (nothing leaked);
  * a canary greedy request gives the same text after the run as before it.

The generator is a seeded ``random.Random``: the same ``--seed`` makes the same requests. The
report counts requests by status and lists every failure class (status + error-message shape)
with an example. Exit code 0 when every property held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOSTILE_NUMBERS: list[Any] = [
    0,
    -1,
    1,
    2,
    7,
    255,
    256,
    4096,
    2**31 - 1,
    2**31,
    2**32,
    2**32 + 1,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    2**64 + 1,
    -(2**31),
    -(2**63),
    -(2**63) - 1,
    -(2**64),
    10**30,
    0.0,
    -0.0,
    0.5,
    1.5,
    1e-320,
    1e-7,
    1e38,
    3.5e38,
    1e39,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
]
HOSTILE_STRINGS: list[str] = [
    "",
    " ",
    "x",
    "\x00",
    "\ud800",
    "a\udfffb",
    "\ud83d\ude00",
    "\u202e",
    "\ufeff",
    "\n" * 50,
    "<|endoftext|>",
    "</s>",
    "<s>",
    "{{ raise_exception('x') }}",
    "{% for x in y %}",
    "\u00e9" * 1000,
    "x" * 20000,
    "null",
    "[]",
    "0",
]
_FIELDS_COMMON = [
    "model",
    "n",
    "best_of",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "logit_bias",
    "stream",
    "stream_options",
    "user",
    "cache_salt",
    "return_tokens_as_token_ids",
    "use_beam_search",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "response_format",
    "structured_outputs",
    "guided_regex",
    "guided_choice",
    "priority",
    "max_tokens",
    "logprobs",
    "spaces_between_special_tokens",
    "an_unknown_field",
]
_FIELDS_COMPLETION = _FIELDS_COMMON + ["prompt", "echo", "suffix", "add_special_tokens"]
_FIELDS_CHAT = _FIELDS_COMMON + [
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "documents",
    "echo",
]


_FIELDS_RESPONSES = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "previous_response_id",
    "metadata",
    "truncation",
    "include",
    "seed",
    "an_unknown_field",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"enum": ["a", "b"]}},
                "required": ["x"],
            },
        },
    }
]


def _deep(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    v = leaf
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


class BodyMaker:
    """Seeded request bodies: a valid base plus unusual settings or hostile mutations."""

    FAMILIES = (
        "prompt",
        "messages",
        "tokens",
        "seed-overflow",
        "stop",
        "stop-ids",
        "drop-field",
        "field-value",
        "truncated",
        "bom",
        "bad-utf8",
        "deep-brackets",
        "nan-literal",
        "content-type",
        "request-id",
    )

    def __init__(
        self,
        rng: random.Random,
        model: str,
        vocab: int,
        max_model_len: int,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.rng = rng
        self.model = model
        self.vocab = vocab
        self.max_model_len = max_model_len
        self.skip = skip  # hostile families not to use (triage: isolate one failure class)

    # ---- values ---------------------------------------------------------------------------
    def token_ids(self) -> list[int]:
        r = self.rng
        n = r.choice([1, 2, 5, 17, 64, 300])
        return [r.randrange(3, self.vocab) for _ in range(n)]

    def hostile_value(self) -> Any:
        r = self.rng
        pick = r.random()
        if pick < 0.35:
            return r.choice(HOSTILE_NUMBERS)
        if pick < 0.55:
            return r.choice(HOSTILE_STRINGS)
        if pick < 0.62:
            return r.choice([None, True, False])
        if pick < 0.70:
            return r.choice([[], {}, [None], [1, "a"], {"type": "json_object"}, {"": None}])
        if pick < 0.78:
            return _deep(r.choice([5, 40, 70, 200, 900]), kind=r.choice(["list", "dict"]))
        if pick < 0.86:
            return [r.choice(HOSTILE_NUMBERS) for _ in range(r.choice([1, 3, 100]))]
        if pick < 0.93:
            return [r.choice(HOSTILE_STRINGS) for _ in range(r.choice([1, 5, 100]))]
        return list(range(r.choice([1000, 50_000])))

    def hostile_prompt(self) -> Any:
        r = self.rng
        v = self.vocab
        return r.choice(
            [
                lambda: [v, v + 1],
                lambda: [-1, 5],
                lambda: [2**32 + 5],
                lambda: [2**63],
                lambda: [1.5, 2],
                lambda: [self.token_ids(), []],
                lambda: [self.token_ids() for _ in range(300)],
                lambda: ["hello"] * r.choice([2, 257, 1000]),
                lambda: [
                    r.randrange(0, v) for _ in range(self.max_model_len + r.choice([-1, 0, 5]))
                ],
                lambda: "hello " * r.choice([10, 3000, 100_000]),
                lambda: r.choice(HOSTILE_STRINGS),
                lambda: [[r.randrange(0, v)] * 3, "x"],
                list,
                lambda: [[]],
            ]
        )()

    def hostile_messages(self) -> Any:
        r = self.rng
        good = {"role": "user", "content": "hello there"}
        return r.choice(
            [
                list,
                lambda: [{"role": r.choice(HOSTILE_STRINGS), "content": "x"}],
                lambda: [{"role": "user"}],
                lambda: [{"role": "user", "content": None}],
                lambda: [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
                lambda: [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": r.choice(HOSTILE_STRINGS)}],
                    }
                ],
                lambda: [{"role": "user", "content": [{"type": "text"}]}],
                lambda: [{"role": "user", "content": ["not a dict"]}],
                lambda: [{"role": "user", "content": _deep(r.choice([3, 80, 500]))}],
                lambda: [
                    good,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {
                                    "name": "f",
                                    "arguments": "[" * r.choice([10, 100, 5000]) + "]" * 3,
                                },
                            }
                        ],
                    },
                ],
                lambda: [
                    good,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "function": {
                                    "name": "f",
                                    "arguments": json.dumps(_deep(r.choice([20, 90]))),
                                }
                            }
                        ],
                    },
                ],
                lambda: [good, {"role": "assistant", "tool_calls": "nope"}],
                lambda: [
                    good,
                    {"role": "tool", "content": "42", "tool_call_id": r.choice(HOSTILE_STRINGS)},
                ],
                lambda: [good] * r.choice([2, 100, 3000]),
                lambda: [{"role": "user", "content": "x" * r.choice([100, 300_000])}],
                lambda: [{"role": "user", "content": "hi", "extra": _deep(200, kind="dict")}],
                lambda: "hello",
                lambda: [{"role": "assistant", "content": "hi"}],
            ]
        )()

    # ---- bodies ---------------------------------------------------------------------------
    def base(self, chat: bool) -> dict:
        r = self.rng
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": r.choice([1, 2, 4, 8]),
            "temperature": r.choice([0, 0.7, 1.0]),
        }
        if chat:
            body["messages"] = [{"role": "user", "content": "hello there"}]
        else:
            body["prompt"] = r.choice(["hello", self.token_ids(), ["a", "b"]])
        if r.random() < 0.4:
            body["stream"] = True
        if r.random() < 0.3:
            body["n"] = r.choice([1, 2, 3])
        if r.random() < 0.3:
            top = 2**63 - 3 if "seed-overflow" in self.skip else 2**63 - 1  # n <= 3 here
            body["seed"] = r.choice([0, 7, top, -(2**63)])
        return body

    def edge(self, body: dict, chat: bool) -> None:
        """A valid but unusual setting (the engine paths, not the parser, get exercised)."""
        r = self.rng
        v = self.vocab
        history = [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": [1, {"y": 2}]}'},
                    }
                ],
            },
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
            {"role": "user", "content": "again"},
        ]
        r.choice(
            [
                lambda: body.update(temperature=r.choice([0.01, 2.0, 1e-6, 100.0])),
                lambda: body.update(top_k=r.choice([-1, 1, 2, v, v * 10, 2**31 - 1])),
                lambda: body.update(top_p=r.choice([1e-9, 0.01, 0.5, 1.0])),
                lambda: body.update(min_p=r.choice([0.0, 0.5, 1.0])),
                lambda: body.update(
                    repetition_penalty=r.choice([0.01, 2.0, 1e6]),
                    presence_penalty=r.choice([-2, 2]),
                    frequency_penalty=r.choice([-2, 2]),
                ),
                lambda: body.update(n=r.choice([2, 4, 16]), seed=2**63 - 1 - 15),
                lambda: body.update(n=r.choice([2, 3]), seed=-(2**63)),
                lambda: (
                    body.update(logprobs=True, top_logprobs=r.choice([0, 1, 20]))
                    if chat
                    else body.update(logprobs=r.choice([0, 1, 20]))
                ),
                lambda: body.update(
                    stop=r.choice([["e"], ["the", "a"], "\n", ["\u00e9", "\ud83d\ude00"]]),
                    include_stop_str_in_output=r.random() < 0.5,
                ),
                lambda: body.update(
                    stop_token_ids=[r.randrange(v) for _ in range(r.choice([1, 8]))],
                    min_tokens=r.choice([0, 1, 3]),
                ),
                lambda: body.update(ignore_eos=True, max_tokens=r.choice([16, 64])),
                lambda: body.pop("max_tokens", None),
                lambda: body.update(cache_salt=r.choice(["tenant-a", "b" * 256])),
                lambda: body.update(skip_special_tokens=False, spaces_between_special_tokens=False),
                lambda: body.update(return_tokens_as_token_ids=True, logprobs=True if chat else 2),
                lambda: body.update(
                    stream=True,
                    stream_options={
                        "include_usage": True,
                        "continuous_usage_stats": r.random() < 0.5,
                    },
                ),
                lambda: body.update(truncate_prompt_tokens=r.choice([-1, 1, 5])),
                lambda: (
                    body.update(messages=history)
                    if chat
                    else body.update(
                        prompt=[
                            r.randrange(v) for _ in range(self.max_model_len - r.choice([1, 2, 8]))
                        ],
                        max_tokens=1,
                    )
                ),
                lambda: (
                    body.update(messages=history * 3)
                    if chat
                    else body.update(prompt=[self.token_ids() for _ in range(r.choice([2, 8]))])
                ),
                lambda: body.update(user="u", priority=r.choice([0, -5, 10]), an_unknown_field=1),
                lambda: body.update(
                    logit_bias={
                        str(r.randrange(v)): r.choice([-100, -1.5, 0, 5, 100])
                        for _ in range(r.choice([1, 5, 300]))
                    }
                ),
                lambda: body.update(
                    allowed_token_ids=[r.randrange(v) for _ in range(r.choice([1, 3, 50]))]
                ),
                lambda: (
                    body.update(
                        tools=TOOLS,
                        tool_choice=r.choice(
                            ["none", "required", {"type": "function", "function": {"name": "f"}}]
                        ),
                        parallel_tool_calls=r.random() < 0.5,
                        max_tokens=r.choice([8, 64]),
                    )
                    if chat
                    else body.update(logit_bias={"0": 1.0})
                ),
            ]
        )()

    def responses_body(self) -> dict[str, Any]:
        """A valid ``/v1/responses`` body: text, function calls, their outputs, JSON output."""
        r = self.rng
        body: dict[str, Any] = {
            "model": self.model,
            "max_output_tokens": r.choice([1, 4, 16]),
            "input": r.choice(
                [
                    "hello",
                    [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                    [
                        {"role": "user", "content": "hi"},
                        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "3"},
                    ],
                ]
            ),
        }
        if r.random() < 0.4:
            body["stream"] = True
        if r.random() < 0.3:
            body["instructions"] = "be brief"
        if r.random() < 0.4:
            body["tools"] = [{"type": "function", **TOOLS[0]["function"]}]
            body["tool_choice"] = r.choice(["none", "required", {"type": "function", "name": "f"}])
        elif r.random() < 0.3:
            body["text"] = {"format": {"type": "json_object"}}
        return body

    def request(self) -> tuple[str, bytes, dict[str, Any]]:
        """(path, raw body, headers)."""
        r = self.rng
        chat = r.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if r.random() < 0.04:
            path = r.choice(["/tokenize", "/detokenize"])
        body = self.base(chat)
        if path == "/tokenize":
            body = (
                {"model": self.model, "prompt": "hello"}
                if not chat
                else {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}
            )
        if path == "/detokenize":
            body = {"model": self.model, "tokens": self.token_ids()}
        fields = _FIELDS_CHAT if chat else _FIELDS_COMPLETION
        if r.random() < 0.06:
            path, body, fields = "/v1/responses", self.responses_body(), _FIELDS_RESPONSES
        hostile = r.random() < 0.55 or path in ("/tokenize", "/detokenize")
        if not hostile and path != "/v1/responses":
            for _ in range(r.choice([1, 2, 3, 4])):
                self.edge(body, chat)
        for _ in range(r.choice([1, 1, 2, 3]) if hostile else 0):
            roll = r.random()
            if roll < 0.12 and path == "/v1/completions":
                family = "prompt"
            elif roll < 0.24 and path == "/v1/chat/completions":
                family = "messages"
            elif roll < 0.30 and path == "/detokenize":
                family = "tokens"
            elif roll < 0.36:
                family = "seed-overflow"
            elif roll < 0.42:
                family = "stop"
            elif roll < 0.46:
                family = "stop-ids"
            elif roll < 0.50:
                family = "drop-field"
            else:
                family = "field-value"
            if family in self.skip:
                continue
            if family == "prompt":
                body["prompt"] = self.hostile_prompt()
            elif family == "messages":
                body["messages"] = self.hostile_messages()
            elif family == "tokens":
                body["tokens"] = self.hostile_prompt()
            elif family == "seed-overflow":  # the case that took both decode workers down
                body.update(
                    n=r.choice([2, 3, 128]), seed=r.choice([2**63 - 1, 2**63 - 2]), temperature=1
                )
            elif family == "stop":
                body["stop"] = r.choice(
                    [
                        ["x"] * 65,
                        ["a" * 9000],
                        [""],
                        "\ud800",
                        ["e"] * 10,
                        [r.choice(HOSTILE_STRINGS)],
                    ]
                )
            elif family == "stop-ids":
                body["stop_token_ids"] = r.choice([[self.vocab], [-1], list(range(2000)), [2**32]])
            elif family == "drop-field":
                body.pop(r.choice(sorted(body)), None)
            else:
                body[r.choice(fields)] = self.hostile_value()
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        headers: dict[str, Any] = {"content-type": "application/json"}
        roll = r.random() if hostile else 1.0
        raw_family = (
            "truncated"
            if roll < 0.03
            else "bom"
            if roll < 0.05
            else "bad-utf8"
            if roll < 0.07
            else "deep-brackets"
            if roll < 0.085
            else "nan-literal"
            if roll < 0.095
            else "content-type"
            if roll < 0.11
            else "request-id"
            if roll < 0.16
            else ""
        )
        if raw_family in self.skip:
            raw_family = ""
        if raw_family == "truncated":
            raw = raw[: r.randrange(0, max(1, len(raw)))]
        elif raw_family == "bom":
            raw = b"\xff\xfe" + raw
        elif raw_family == "bad-utf8":
            raw = raw.replace(b'"hello', b'"\xc3\x28hello', 1)
        elif raw_family == "deep-brackets":
            raw = b"[" * 100_000 + b"]" * 100_000
        elif raw_family == "nan-literal":
            raw = b'{"prompt": NaN, "max_tokens": Infinity}'
        elif raw_family == "content-type":
            headers["content-type"] = r.choice(
                [
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "application/json; charset=latin-1",
                ]
            )
        elif raw_family == "request-id":
            headers["x-request-id"] = r.choice(
                ["same-id", "same-id", "x" * 5000, "\u00e9".encode(), ""]
            )
        return path, raw, headers


@dataclass
class Outcome:
    kind: str  # "http" | "grpc"
    status: str
    ok: bool  # the properties held for this request
    detail: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # failure class -> example
    worker_problems: list[str] = field(default_factory=list)
    canary_changed: bool = False

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.worker_problems and not self.canary_changed

    def summary(self) -> dict:
        return {
            "requests": sum(o.kind == "http" for o in self.outcomes),
            "grpc_calls": sum(o.kind == "grpc" for o in self.outcomes),
            "statuses": dict(
                sorted(Counter(f"{o.kind}:{o.status}" for o in self.outcomes).items())
            ),
            "failures": len(self.failures),
            "failure_classes": self.classes,
            "worker_problems": self.worker_problems,
            "canary_changed": self.canary_changed,
            "ok": self.ok,
        }


_NON_FINITE = re.compile(rb"[:\[,]\s*-?(?:NaN|Infinity)\s*[,\]}]")


def _failure_class(status: str, detail: str) -> str:
    shape = re.sub(r"\d+", "N", detail)[:90]
    return f"{status}: {shape}"


# ---- HTTP ---------------------------------------------------------------------------------


async def _http_one(
    client, url: str, path: str, raw: bytes, headers: dict[str, Any], timeout_s: float
) -> Outcome:
    import httpx

    try:
        async with client.stream(
            "POST", url + path, content=raw, headers=headers, timeout=timeout_s
        ) as resp:
            body = b""
            async for chunk in resp.aiter_bytes():
                body += chunk
            status = resp.status_code
            ctype = resp.headers.get("content-type", "")
    except httpx.TimeoutException as e:
        return Outcome("http", "timeout", False, f"no complete answer in {timeout_s:g} s ({e!r})")
    except (httpx.TransportError, httpx.ProtocolError) as e:
        return Outcome("http", "connection_error", False, repr(e))
    text = body.decode("utf-8", "replace")
    if status >= 500:
        ok = False
        if status == 503:
            try:
                err = json.loads(body)["error"]
                ok = isinstance(err.get("message"), str)
            except (ValueError, KeyError, TypeError):
                ok = False
        return Outcome("http", str(status), ok, text[:200])
    if "text/event-stream" in ctype and status == 200 and path == "/v1/responses":
        # a Responses stream ends with response.completed / .incomplete, or an error event
        last = text.rstrip().rsplit("\n\n", 1)[-1]
        if last.startswith("event: error"):
            try:
                code = json.loads(last.split("data: ", 1)[1])["code"]
            except (ValueError, KeyError, IndexError):
                return Outcome("http", "stream_bad_error", False, last[:200])
            if isinstance(code, int) and code >= 500 and code != 503:
                return Outcome("http", f"stream_error_{code}", False, last[:200])
            return Outcome("http", "200-stream-error", True)
        if not last.startswith(("event: response.completed", "event: response.incomplete")):
            return Outcome("http", "stream_cut", False, text[-200:])
        return Outcome("http", "200-stream", True)
    if "text/event-stream" in ctype and status == 200:
        # a stream must end with [DONE]; an error event inside it must not be a 5xx other
        # than 503
        if not text.rstrip().endswith("data: [DONE]"):
            return Outcome("http", "stream_cut", False, text[-200:])
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                try:
                    err = json.loads(line[6:])["error"]
                except (ValueError, KeyError):
                    continue
                code = err.get("code")
                if isinstance(code, int) and code >= 500 and code != 503:
                    return Outcome("http", f"stream_error_{code}", False, line[:200])
        return Outcome("http", "200-stream", True)
    if status >= 400:
        try:
            err = json.loads(body)["error"]
            if not isinstance(err.get("message"), str):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return Outcome("http", f"{status}-not-json", False, text[:200])
    elif _NON_FINITE.search(raw):  # NaN / Infinity are not JSON numbers: never accepted
        return Outcome(
            "http", f"{status}-accepted-non-finite", False, raw[:200].decode("utf-8", "replace")
        )
    return Outcome("http", str(status), True)


async def run_http(
    url: str,
    maker: BodyMaker,
    n: int,
    concurrency: int,
    timeout_s: float,
    report: Report,
    progress: bool = True,
) -> None:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    reqs = [maker.request() for _ in range(n)]
    done = 0
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def one(req):
            nonlocal done
            async with sem:
                out = await _http_one(client, url, *req, timeout_s=timeout_s)
            report.outcomes.append(out)
            if not out.ok:
                cls = _failure_class(out.status, out.detail)
                report.classes.setdefault(cls, f"{req[0]} {req[1][:300]!r}")
            done += 1
            if progress and (done % 50 == 0 or done == n):
                print(
                    f"[fuzz] http {done}/{n}  failures {len(report.failures)}  "
                    f"{time.monotonic() - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )

        await asyncio.gather(*(one(r) for r in reqs))


async def canary(url: str, model: str) -> list[str]:
    import httpx

    async with httpx.AsyncClient() as client:
        out = []
        for body in (
            {
                "model": model,
                "prompt": "The canary sings",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
            {
                "model": model,
                "messages": [{"role": "user", "content": "canary?"}],
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = await client.post(url + path, json=body, timeout=120)
            r.raise_for_status()
            c = r.json()["choices"][0]
            out.append(c.get("text") or c["message"]["content"])
        return out


# ---- gRPC ---------------------------------------------------------------------------------

_GRPC_OK = {
    "OK",
    "INVALID_ARGUMENT",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
    "UNAVAILABLE",
    "ABORTED",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
}


def _grpc_sampling(rng: random.Random, hostile: bool):
    from shared.proto import pdserve_pb2 as pb

    if not hostile:
        m = pb.SamplingParams(
            n=rng.choice([1, 1, 2, 3]),
            max_tokens=rng.choice([1, 2, 4]),
            temperature=rng.choice([0.0, 0.8]),
        )
        if rng.random() < 0.5:
            m.seed = rng.choice([0, 2**63 - 3, -(2**63)])
        if rng.random() < 0.3:
            m.logprobs = rng.choice([0, 3, 20])
        return m
    m = pb.SamplingParams(n=rng.choice([0, 1, 2, 3, 1000, 2**32 - 1]))
    floats = [0.0, 1.0, -1.0, 0.5, 1e30, float("nan"), float("inf"), -float("inf"), 3.0]
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if rng.random() < 0.3:
            setattr(m, name, rng.choice(floats))
    if rng.random() < 0.3:
        m.top_k = rng.choice([-2, -1, 0, 1, 5, 2**31 - 1])
    if rng.random() < 0.5:
        m.seed = rng.choice([0, 1, 2**63 - 1, -(2**63), 2**63 - 2])
    if rng.random() < 0.7:
        m.max_tokens = rng.choice([0, 1, 2, 4, 2**32 - 1])
    if rng.random() < 0.2:
        m.min_tokens = rng.choice([0, 3, 2**32 - 1])
    if rng.random() < 0.2:
        m.stop_token_ids.extend(rng.choice([[0], [2**32 - 1], list(range(3000)), [10**6]]))
    if rng.random() < 0.2:
        m.logprobs = rng.choice([0, 5, 20, 21, 2**32 - 1])
    m.ignore_eos = rng.random() < 0.5
    return m


def grpc_requests(
    rng: random.Random, vocab: int, workers: dict[str, dict], n: int, allow_hostile: bool = True
) -> list:
    """(role, address, request) triples of mutated Generate / Prefill calls."""
    from shared.proto import pdserve_pb2 as pb

    decode = [w for w in workers.values() if w.get("role") == "decode"]
    prefill = [w for w in workers.values() if w.get("role") == "prefill"]
    out = []
    for i in range(n):
        hostile = rng.random() < 0.6 and allow_hostile
        ids_choice = rng.random() if hostile else 1.0
        if ids_choice < 0.15:
            ids = [vocab, vocab + 7]
        elif ids_choice < 0.2:
            ids = [2**32 - 1]
        elif ids_choice < 0.25:
            ids = []
        elif ids_choice < 0.3:
            ids = [rng.randrange(vocab) for _ in range(rng.choice([5000, 70000]))]
        else:
            ids = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 17, 40]))]
        rid = rng.choice([f"fz-{i}", "fz-same", "", "x" * 300, "\u00e9"]) if hostile else f"fz-{i}"
        if prefill and rng.random() < 0.35:
            w = rng.choice(prefill)
            nb = -(-len(ids) // 16)
            first = rng.choice([0, 0, 1, 5, 2**32 - 1]) if hostile else 0
            nblk = max(0, nb - first)
            dst = rng.choice([list(range(nblk)), [2**32 - 1] * nblk, [], list(range(nblk + 3))])
            req = pb.PrefillRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=_grpc_sampling(rng, hostile),
                cache_salt=rng.choice(["", "s", "y" * 5000]),
                decode_kv_address=rng.choice(
                    [b"", b"\x00garbage", os.urandom(64), b"\xff" * 10000]
                ),
                first_block_index=first,
                dst_block_ids=dst,
                transfer_id=rng.choice(["", "t", f"t{i}"]),
            )
            out.append(("prefill", w["grpc"], req))
        elif decode:
            w = rng.choice(decode)
            req = pb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=_grpc_sampling(rng, hostile),
                cache_salt=rng.choice(["", "s", "z" * 5000]) if hostile else "",
                deadline_s=rng.choice([0.0, 5.0, -1.0, float("nan"), float("inf"), 1e-9])
                if hostile
                else 30.0,
            )
            if prefill and rng.random() < 0.4:
                req.prefill_address = (
                    rng.choice([rng.choice(prefill)["grpc"], "127.0.0.1:1", "nonsense", "x" * 1000])
                    if hostile
                    else rng.choice(prefill)["grpc"]
                )
            if hostile and rng.random() < 0.3:
                for _ in range(rng.choice([1, 2, 5])):
                    req.resume.append(
                        pb.ResumeTokens(
                            index=rng.choice([0, 1, 7, 2**32 - 1]),
                            token_ids=rng.choice([[1, 2], [vocab], [], list(range(3000))]),
                        )
                    )
            out.append(("decode", w["grpc"], req))
    return out


async def run_grpc(
    rng: random.Random,
    vocab: int,
    workers: dict[str, dict],
    n: int,
    concurrency: int,
    timeout_s: float,
    report: Report,
    hostile: bool = True,
    security: Any = None,
) -> None:
    import grpc

    from shared.security import ClusterSecurity

    security = security or ClusterSecurity.from_env()
    md = security.call_metadata

    from shared.proto import pdserve_pb2_grpc as pb_grpc

    calls = grpc_requests(rng, vocab, workers, n, hostile)
    channels: dict[str, grpc.aio.Channel] = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(role: str, address: str, req) -> None:
        ch = channels.get(address)
        if ch is None:
            ch = channels[address] = security.aio_channel(
                address, [("grpc.max_send_message_length", 64 << 20)]
            )
        async with sem:
            try:
                if role == "decode":
                    stub = pb_grpc.DecodeWorkerStub(ch)
                    async for _ in stub.Generate(req, timeout=timeout_s, metadata=md):
                        pass
                else:
                    await pb_grpc.PrefillWorkerStub(ch).Prefill(req, timeout=timeout_s, metadata=md)
                status, detail = "OK", ""
            except grpc.aio.AioRpcError as e:
                status, detail = e.code().name, e.details() or ""
        out = Outcome("grpc", f"{role}:{status}", status in _GRPC_OK, detail[:200])
        report.outcomes.append(out)
        if not out.ok:
            report.classes.setdefault(
                _failure_class(out.status, out.detail), f"{role} {str(req)[:300]!r}"
            )

    try:
        await asyncio.gather(*(one(*c) for c in calls))
    finally:
        for ch in channels.values():
            await ch.close()


# ---- workers ------------------------------------------------------------------------------


def read_workers(run_dir: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(run_dir.glob("*.ready.json")):
        out[f.name.removesuffix(".ready.json")] = json.loads(f.read_text())
    return out


def check_workers(
    workers: dict[str, dict], settle_s: float = 30.0, security: Any = None
) -> list[str]:
    """Alive, SERVING, integrity clean and (once idle) no block held, for every worker."""
    import grpc

    from shared.security import ClusterSecurity

    security = security or ClusterSecurity.from_env()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.proto import pdserve_pb2 as pb
    from shared.proto import pdserve_pb2_grpc as pb_grpc

    problems = []
    for name, info in workers.items():
        pid = info.get("pid")
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                problems.append(f"{name}: process {pid} is gone")
                continue
        try:
            with security.channel(info["grpc"]) as ch:
                h = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                if h.status != health_pb2.HealthCheckResponse.SERVING:
                    problems.append(f"{name}: health {h.status}")
                stub = (
                    pb_grpc.DecodeWorkerStub(ch)
                    if info.get("role") == "decode"
                    else pb_grpc.PrefillWorkerStub(ch)
                )
                deadline = time.monotonic() + settle_s
                while True:
                    s = stub.Stats(pb.StatsRequest(check_integrity=True), timeout=10)
                    idle = s.running == 0 and s.waiting == 0 and s.used_blocks == 0
                    if (idle and s.integrity_ok) or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if not s.integrity_ok:
                    problems.append(f"{name}: integrity: {s.integrity_error}")
                elif not idle:
                    problems.append(
                        f"{name}: not idle {settle_s:g} s after the run: running "
                        f"{s.running}, waiting {s.waiting}, blocks in use "
                        f"{s.used_blocks}"
                    )
        except grpc.RpcError as e:
            problems.append(f"{name}: {e.code().name}: {e.details()}")
    return problems


# ---- entry point --------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--run-dir",
        default=None,
        help="the cluster's run dir (pdserve up --run-dir): workers' ready files",
    )
    parser.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    parser.add_argument(
        "--model-dir", default=None, help="model directory, for its vocabulary size (default 32000)"
    )
    parser.add_argument("--requests", type=int, default=400, help="HTTP requests")
    parser.add_argument("--grpc-requests", type=int, default=200, help="gRPC calls to the workers")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--output", default=None, help="write the report as JSON here")
    parser.add_argument(
        "--skip-family",
        action="append",
        default=[],
        choices=BodyMaker.FAMILIES,
        help="leave out one family of hostile HTTP mutations (repeatable): "
        "isolates failure classes when one of them takes workers down",
    )
    parser.add_argument(
        "--no-grpc-hostile", action="store_true", help="send only well-formed gRPC calls"
    )


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(fuzz(args))
    s = report.summary()
    print(json.dumps(s, indent=2, ensure_ascii=True))
    if args.output:
        Path(args.output).write_text(json.dumps(s, indent=2, ensure_ascii=True))
    return 0 if report.ok else 1


async def fuzz(args: argparse.Namespace) -> Report:
    import httpx

    url = args.url.rstrip("/")
    async with httpx.AsyncClient() as c:
        models = (await c.get(url + "/v1/models", timeout=30)).json()["data"]
    model = args.model or models[0]["id"]
    max_model_len = int(models[0].get("max_model_len") or 2048)
    vocab = 32000
    if args.model_dir:
        cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
        vocab = int(cfg["vocab_size"])
    workers = read_workers(Path(args.run_dir)) if args.run_dir else {}
    from shared.security import ClusterSecurity

    security = ClusterSecurity.for_run_dir(args.run_dir) if args.run_dir else None
    report = Report()
    before = await canary(url, model)
    rng = random.Random(args.seed)
    maker = BodyMaker(
        rng, model, vocab, max_model_len, frozenset(getattr(args, "skip_family", ()) or ())
    )
    await run_http(url, maker, args.requests, args.concurrency, args.timeout, report)
    if workers and args.grpc_requests:
        await run_grpc(
            random.Random(args.seed + 1),
            vocab,
            workers,
            args.grpc_requests,
            args.concurrency,
            args.timeout,
            report,
            hostile=not getattr(args, "no_grpc_hostile", False),
            security=security,
        )
    if workers:
        report.worker_problems = await asyncio.to_thread(check_workers, workers, 30.0, security)
    try:
        after = await canary(url, model)
        report.canary_changed = after != before
    except Exception as e:  # noqa: BLE001 - the cluster stopped answering: a failure
        report.worker_problems.append(f"canary failed after the run: {e!r}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve fuzz", description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

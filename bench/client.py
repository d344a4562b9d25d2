"""One streamed OpenAI request, timed the way ``vllm bench serve`` times it.

* TTFT: from just before the POST to the first SSE event whose ``choices`` is non-empty (for
  chat that is usually the role-only delta, as in vLLM).
* ITL: the gap between each later event with non-empty ``choices`` and the one before it.
* E2E latency: from the POST to the last event with non-empty ``choices`` (the usage event
  and ``[DONE]`` come after and are not counted).
* ``usage`` from the final ``{"choices": [], "usage": ...}`` event gives prompt and output
  token counts; without it the caller re-tokenizes the text.

All times are ``time.perf_counter()`` seconds. Per event the client does one ``json.loads``
and a few dict lookups; nothing else runs per chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

_ERROR_TEXT_LIMIT = 500


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one request. Times are seconds; ``start`` is relative to the run start."""

    index: int  # order of dispatch within the run
    session_id: int
    turn: int
    prompt_len: int  # client-side count; replaced by usage.prompt_tokens when the server sends it
    max_tokens: int
    start: float = 0.0
    end: float = 0.0  # when the request finished or failed, relative to the run start
    success: bool = False
    error: str = ""
    # Our own count of a completions prompt (None for chat, whose template the server applies);
    # compared with the server's usage to catch a tokenizer that differs from the server's.
    client_prompt_len: int | None = None
    http_status: int | None = None
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None  # from usage, or re-tokenized by the runner
    prompt_tokens_from_server: bool = False
    output_tokens_from_server: bool = False
    text: str = ""


def build_payload(
    backend: str,
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    temperature: float | None,
    ignore_eos: bool,
    extra: dict | None,
) -> bytes:
    """The JSON body for ``/v1/completions`` (``prompt``) or ``/v1/chat/completions``
    (``messages``), always streaming with ``stream_options.include_usage``."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "chat":
        body["messages"] = prompt
        body["max_completion_tokens"] = max_tokens
        body["max_tokens"] = max_tokens  # servers that predate max_completion_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension; ends runs at EOS otherwise
    if extra:
        body.update(extra)
    return json.dumps(body).encode()


class _StreamError(Exception):
    """An ``error`` event arrived in the stream."""


class _Stream:
    """Parses SSE events and stamps times into a record; one instance per request."""

    __slots__ = ("done", "first", "last", "pieces", "rec", "st")

    def __init__(self, rec: RequestRecord, st: float):
        self.rec = rec
        self.st = st
        self.last = st
        self.first = True
        self.done = False
        self.pieces: list[str] = []

    def feed(self, events: list[bytes], now: float) -> None:
        rec = self.rec
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # ":" comments (pings), "event:", "id:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    continue
                obj = json.loads(data)
                choices = obj.get("choices")
                if choices:
                    if self.first:
                        rec.ttft = now - self.st
                        self.first = False
                    else:
                        rec.itl.append(now - self.last)
                    self.last = now
                    c0 = choices[0]
                    piece = c0.get("text")
                    if piece is None:
                        delta = c0.get("delta")
                        piece = delta.get("content") if delta else None
                    if piece:
                        self.pieces.append(piece)
                elif "error" in obj:
                    err = obj["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise _StreamError(f"error event in stream: {msg}")
                usage = obj.get("usage")
                if usage:
                    _take_usage(rec, usage)


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: RequestRecord,
    t0: float,
) -> None:
    """POST ``body`` to ``url`` and fill ``rec``; never raises except on cancellation.

    A non-200 status, a transport error, an ``error`` event, a stream that closes without
    ``data: [DONE]`` or one with no event carrying ``choices`` marks the record failed with a
    readable message. The caller's aiohttp timeout bounds the whole request.
    """
    st = time.perf_counter()
    rec.start = st - t0
    stream = _Stream(rec, st)
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                detail = (await resp.text())[:_ERROR_TEXT_LIMIT].strip()
                rec.error = f"HTTP {resp.status} {resp.reason or ''}: {detail}".strip()
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                if b"\r" in buf:  # CRLF line ends (a lone CR waits for its LF in the next read)
                    buf = buf.replace(b"\r\n", b"\n")
                if b"\n\n" not in buf:
                    continue
                *events, buf = buf.split(b"\n\n")
                stream.feed(events, time.perf_counter())
            if buf.strip():  # a last event without its blank line
                stream.feed([buf], time.perf_counter())
        if stream.first:
            rec.error = "no event with non-empty choices (no first token)"
        elif not stream.done:
            rec.error = "stream closed before data: [DONE]"
        else:
            rec.success = True
            rec.latency = stream.last - st
    except _StreamError as e:
        rec.error = str(e)[:_ERROR_TEXT_LIMIT]
    except TimeoutError:
        rec.error = f"timed out after {time.perf_counter() - st:.1f} s"
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"[:_ERROR_TEXT_LIMIT]
    except (ValueError, AttributeError, TypeError) as e:  # malformed JSON or event shape
        rec.error = f"malformed stream event: {type(e).__name__}: {e}"[:_ERROR_TEXT_LIMIT]
    finally:
        rec.text = "".join(stream.pieces)
        rec.end = time.perf_counter() - t0


def _take_usage(rec: RequestRecord, usage: dict) -> None:
    ct = usage.get("completion_tokens")
    if isinstance(ct, int):
        rec.output_tokens = ct
        rec.output_tokens_from_server = True
    pt = usage.get("prompt_tokens")
    if isinstance(pt, int):
        rec.prompt_len = pt
        rec.prompt_tokens_from_server = True

"""A deterministic OpenAI-compatible streaming server for the bench tests.

Run: ``python mock_openai_server.py --port PORT --model-dir DIR``. It streams
``/v1/completions`` and ``/v1/chat/completions`` as vLLM does (content events, then a
``{"choices": [], "usage": ...}`` event, then ``data: [DONE]``). Each request's behaviour is
read from its ``model`` field, ``"mock"`` or ``"mock:key=value,key=value"``:

    ttft=S        seconds before the first content event (default 0)
    itl=S         seconds between content events (default 0)
    usage=0|1     send the usage event (default 1)
    prompt=N      report N prompt tokens instead of counting them
    out_scale=K   report K x the number of content events as completion tokens
    fail_every=K  answer every K-th request of this model name with HTTP 500
    error_after=N send an ``error`` event after N tokens
    drop_after=N  close the connection after N tokens, without [DONE]
    eos_after=N   stop after N tokens unless the request has ignore_eos
    crlf=1        end lines with CRLF and add ": ping" comment lines

``GET /mock/requests?model=NAME`` returns the bodies and headers it got for that model name;
``GET /mock/stats?model=NAME`` the most requests it had in flight at once for it.
"""

import argparse
import asyncio
import json
from collections import defaultdict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta"]


def piece(i: int) -> str:
    return WORDS[i % len(WORDS)]


def _options(model: str) -> dict[str, float]:
    """Numeric options from the model name; others (``tag=...``, to tell runs apart) ignored."""
    _, _, spec = model.partition(":")
    opts = {}
    for kv in filter(None, spec.split(",")):
        k, _, v = kv.partition("=")
        try:
            opts[k] = float(v)
        except ValueError:
            pass
    return opts


def create_app(model_dir: str | None) -> FastAPI:
    tok = None
    if model_dir:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    app = FastAPI()
    seen: dict[str, list[dict]] = defaultdict(list)
    counters: dict[str, int] = defaultdict(int)
    inflight: dict[str, int] = defaultdict(int)
    peak: dict[str, int] = defaultdict(int)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/mock/requests")
    async def requests_seen(model: str):
        return seen.get(model, [])

    @app.get("/mock/stats")
    async def stats(model: str):
        return {"peak_inflight": peak.get(model, 0), "requests": counters.get(model, 0)}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        model = body.get("model", "")
        opts = _options(model)
        seen[model].append({"body": body, "headers": dict(request.headers)})
        counters[model] += 1
        k = int(opts.get("fail_every", 0))
        if k and counters[model] % k == 0:
            return JSONResponse(
                {"error": {"message": "mock failure", "code": 500}}, status_code=500
            )
        if chat:
            prompt_text = "\n".join(m["content"] for m in body["messages"])
        else:
            prompt_text = body["prompt"]
        n_prompt = (
            int(opts["prompt"])
            if "prompt" in opts
            else (len(tok.encode(prompt_text).ids) if tok else len(prompt_text.split()))
        )
        n_out = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if "eos_after" in opts and not body.get("ignore_eos"):
            n_out = min(n_out, int(opts["eos_after"]))
        nl = "\r\n" if opts.get("crlf") else "\n"

        def event(obj) -> bytes:
            return (f"data: {json.dumps(obj)}{nl}{nl}").encode()

        async def gen():
            inflight[model] += 1
            peak[model] = max(peak[model], inflight[model])
            try:
                await asyncio.sleep(opts.get("ttft", 0.0))
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(opts.get("itl", 0.0))
                    if "error_after" in opts and i == int(opts["error_after"]):
                        yield event({"error": {"message": "mock error mid-stream", "code": 500}})
                        return
                    if "drop_after" in opts and i == int(opts["drop_after"]):
                        raise ConnectionAbortedError("mock drops the stream")
                    if opts.get("crlf"):
                        yield f": ping{nl}{nl}".encode()
                    if chat:
                        delta = {"content": piece(i)}
                        if i == 0:
                            delta["role"] = "assistant"
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece(i), "finish_reason": None}
                    yield event({"id": "x", "object": "chunk", "choices": [choice]})
                if opts.get("usage", 1):
                    scale = int(opts.get("out_scale", 1))
                    yield event(
                        {
                            "id": "x",
                            "choices": [],
                            "usage": {
                                "prompt_tokens": n_prompt,
                                "completion_tokens": n_out * scale,
                                "total_tokens": n_prompt + n_out * scale,
                            },
                        }
                    )
                yield f"data: [DONE]{nl}{nl}".encode()
            finally:
                inflight[model] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir")
    a = ap.parse_args()
    uvicorn.run(create_app(a.model_dir), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()

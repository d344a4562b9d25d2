"""``bench/runner.py``'s warm-up does not send the timed prompts (the server's prefix cache
would then hold them and flatter the timed TTFT). Fake tokenizer and transport: no server."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import runner as rn
from bench.datasets import Session, Turn

pytestmark = pytest.mark.unit


class _WordTok:
    """One token per word ``wN``; what TextMaker needs of BenchTokenizer."""

    def token_pool(self, wordlike: bool) -> list[int]:
        return list(range(100, 400))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_warmups_do_not_send_the_timed_prompts(monkeypatch):
    sent: list[tuple[dict, str]] = []

    async def fake_stream_request(http, url, body, headers, rec, t0):
        sent.append((json.loads(body), headers["x-request-id"]))
        rec.success, rec.output_tokens, rec.text = True, rec.max_tokens, "x"

    monkeypatch.setattr(rn, "stream_request", fake_stream_request)
    tok = _WordTok()
    sessions = [
        Session(i, (Turn(tok.decode(list(range(100 + 7 * i, 110 + 7 * i))), 10, 4),))
        for i in range(3)
    ]
    cfg = rn.LoadConfig(
        url="http://x/v1/completions",
        backend="completions",
        model_name="m",
        num_warmups=5,
        disable_tqdm=True,
    )
    asyncio.run(rn.Runner(cfg, tok).run(sessions))
    warm, timed = sent[:5], sent[5:]
    timed_prompts = {b["prompt"] for b, _ in timed}
    assert timed_prompts == {s.turns[0].prompt for s in sessions}
    for body, _ in warm:
        assert body["prompt"] not in timed_prompts
        assert tok.count(body["prompt"]) == 10 and body["max_tokens"] == 4

"""``pdserve bench`` end to end against the mock server in tests/bench/mock_openai_server.py."""

from __future__ import annotations

import itertools
import time

import pytest

from bench.tokenizer import BenchTokenizer

SMALL = ("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "6")


def test_timings_match_injected_delays(bench):
    # 200 ms before the first token, 25 ms between tokens, 10 tokens, 3 requests in flight.
    rc, out, res = bench(
        *SMALL[:-1],
        "10",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        model_name="mock:ttft=0.2,itl=0.025",
    )
    assert rc == 0, out
    m = res["metrics"]
    assert m["completed"] == 6 and m["failed"] == 0
    # The mock counts prompts with the same tokenizer: it saw exactly 32 tokens each.
    assert m["total_input_tokens"] == 6 * 32 and m["prompt_len_mismatches"] == 0
    # Upper bounds leave room for a loaded 2-core CI machine (the test measures the injected
    # delays, not speed) while staying below twice each delay: a unit error, a gap counted
    # twice or the TTFT counted as an ITL still fails.
    assert 200 <= m["ttft"]["mean"] < 350
    assert 24 <= m["itl"]["median"] < 50
    assert 24 <= m["tpot"]["mean"] < 50
    assert 200 + 9 * 25 <= m["e2el"]["mean"] < 200 + 9 * 25 + 225
    for r in res["requests"]:
        assert len(r["itl"]) == 9  # one gap per content event after the first
        assert r["latency"] == pytest.approx(r["ttft"] + sum(r["itl"]), abs=1e-6)
        assert r["output_tokens"] == 10
    assert "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out


def test_chat_backend_timings_and_payload(bench, mock_get):
    name = "mock:ttft=0.1,itl=0.02,tag=chat"
    rc, out, res = bench(
        *SMALL, "--num-prompts", "4", "--backend", "chat", "--max-concurrency", "2", model_name=name
    )
    assert rc == 0, out
    m = res["metrics"]
    # upper bounds below twice each delay (see test_timings_match_injected_delays)
    assert 100 <= m["ttft"]["mean"] < 200 and 19 <= m["itl"]["median"] < 40
    seen = mock_get(f"/mock/requests?model={name}")
    assert len(seen) == 4
    body = seen[0]["body"]
    assert body["messages"][-1]["role"] == "user" and body["max_completion_tokens"] == 6
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_request_payload_and_headers(bench, mock_get):
    name = "mock:tag=payload"
    rc, out, _ = bench(
        *SMALL,
        "--num-prompts",
        "3",
        "--ignore-eos",
        "--api-key",
        "sk-test",
        "--header",
        "X-Extra=1",
        "--extra-body",
        '{"top_k": 5}',
        model_name=name,
    )
    assert rc == 0, out
    seen = mock_get(f"/mock/requests?model={name}")
    assert len(seen) == 3
    for s in seen:
        b, h = s["body"], s["headers"]
        assert b["ignore_eos"] is True and b["temperature"] == 0.0 and b["max_tokens"] == 6
        assert b["stream_options"] == {"include_usage": True} and b["top_k"] == 5
        assert h["authorization"] == "Bearer sk-test" and h["x-extra"] == "1"
        assert h["x-request-id"].startswith("bench-")


def test_ignore_eos_is_needed_for_full_outputs(bench):
    rc, _, res = bench(*SMALL, "--num-prompts", "2", model_name="mock:eos_after=2")
    assert rc == 0 and res["metrics"]["total_output_tokens"] == 4
    rc, _, res = bench(*SMALL, "--num-prompts", "2", "--ignore-eos", model_name="mock:eos_after=2")
    assert rc == 0 and res["metrics"]["total_output_tokens"] == 12


def test_usage_counts_come_from_the_server(bench):
    rc, out, res = bench(*SMALL, "--num-prompts", "4", model_name="mock:prompt=7,out_scale=3")
    assert rc == 0, out
    m = res["metrics"]
    assert m["total_input_tokens"] == 4 * 7  # the server's prompt count, not our 32
    assert m["total_output_tokens"] == 4 * 6 * 3  # usage, not the 6 events
    assert m["usage_from_server"] == {"prompt": 4, "output": 4, "of": 4}
    assert m["prompt_len_mismatches"] == 4 and "Prompts the server counted differently" in out
    # TPOT divides by the server's count: (e2e - ttft) / (18 - 1)
    tpots = [(r["latency"] - r["ttft"]) / 17 for r in res["requests"]]
    assert all(r["output_tokens"] == 18 for r in res["requests"])
    assert m["tpot"]["mean"] == pytest.approx(1000 * sum(tpots) / 4)


def test_without_usage_output_is_retokenized(bench, bench_model):
    rc, out, res = bench(*SMALL, "--num-prompts", "3", "--save-texts", model_name="mock:usage=0")
    assert rc == 0, out
    tok = BenchTokenizer.from_dir(bench_model)
    for r in res["requests"]:
        assert r["text"] == " alpha beta gamma delta epsilon zeta"
        assert r["output_tokens"] == tok.count(r["text"], add_special_tokens=False)
        assert r["prompt_len"] == 32 and not r["output_tokens_from_server"]
    assert "re-tokenized" in out


def test_chat_without_usage_counts_the_rendered_chat_prompt(bench, bench_model, mock_get):
    name = "mock:usage=0,tag=chatnousage"
    rc, out, res = bench(
        *SMALL, "--num-prompts", "2", "--backend", "chat", "--save-texts", model_name=name
    )
    assert rc == 0, out
    tok = BenchTokenizer.from_dir(bench_model)
    sent = {
        s["headers"]["x-request-id"].split("-")[1]: s["body"]["messages"]
        for s in mock_get(f"/mock/requests?model={name}")
    }
    for r in res["requests"]:
        # The prompt as the server's chat template renders it (BOS + ChatML around the message).
        expected = tok.count_chat(sent[str(r["session_id"])])
        assert r["prompt_len"] == expected > 32 and not r["prompt_tokens_from_server"]
        assert r["output_tokens"] == tok.count(r["text"], add_special_tokens=False)


def test_failures_are_counted_with_messages(bench):
    rc, out, res = bench(*SMALL, "--num-prompts", "8", model_name="mock:fail_every=4")
    assert rc == 0, out
    m = res["metrics"]
    assert (m["completed"], m["failed"]) == (6, 2)
    ((msg, n),) = m["errors"].items()
    assert n == 2 and msg.startswith("HTTP 500") and "mock failure" in msg
    assert "mock failure" in out and m["request_throughput"] == pytest.approx(6 / m["duration_s"])
    assert sum(not r["success"] for r in res["requests"]) == 2


@pytest.mark.parametrize(
    "spec,needle", [("error_after=2", "error event in stream: mock error"), ("drop_after=2", "")]
)
def test_mid_stream_failures(bench, spec, needle):
    rc, _, res = bench(*SMALL, "--num-prompts", "2", model_name=f"mock:{spec}")
    assert rc == 1  # nothing succeeded
    m = res["metrics"]
    assert m["failed"] == 2 and m["completed"] == 0
    (msg,) = m["errors"]
    assert needle in msg and msg  # a dropped stream gives aiohttp's payload error or no [DONE]
    assert m["ttft"]["mean"] is None


def test_unreachable_server_fails_fast(bench_model, capsys, free_port):
    from shared.cli import main

    t = time.monotonic()
    rc = main(
        [
            "bench",
            "--model",
            str(bench_model),
            "--port",
            str(free_port),
            *SMALL,
            "--num-prompts",
            "3",
            "--disable-tqdm",
            "--request-timeout",
            "5",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and time.monotonic() - t < 30
    assert "Failed requests:" in out and "Cannot connect" in out


def test_crlf_and_comment_lines_are_parsed(bench):
    rc, out, res = bench(*SMALL, "--num-prompts", "2", model_name="mock:crlf=1")
    assert rc == 0, out
    assert res["metrics"]["completed"] == 2 and res["metrics"]["total_output_tokens"] == 12


def test_max_concurrency_is_respected(bench, mock_get):
    name = "mock:itl=0.01,tag=conc"
    rc, out, res = bench(*SMALL, "--num-prompts", "8", "--max-concurrency", "2", model_name=name)
    assert rc == 0, out
    assert mock_get(f"/mock/stats?model={name}")["peak_inflight"] == 2
    assert res["metrics"]["peak_concurrency"] == 2


def test_request_rate_paces_arrivals(bench):
    rc, out, res = bench(
        *SMALL, "--num-prompts", "10", "--request-rate", "20", model_name="mock:tag=rate"
    )
    assert rc == 0, out
    starts = sorted(r["start"] for r in res["requests"])
    assert 0.15 < starts[-1] < 2.5  # 9 gaps of mean 50 ms, seeded
    assert res["metrics"]["peak_concurrency"] < 10


def test_goodput(bench):
    rc, _, res = bench(
        *SMALL,
        "--num-prompts",
        "4",
        "--goodput",
        "ttft:60",
        "tpot:1000",
        model_name="mock:ttft=0.1",
    )
    assert rc == 0 and res["metrics"]["goodput"]["good_requests"] == 0
    rc, out, res = bench(
        *SMALL,
        "--num-prompts",
        "4",
        "--goodput",
        "ttft:2000",
        "e2el:5000",
        model_name="mock:ttft=0.1",
    )
    g = res["metrics"]["goodput"]
    assert rc == 0 and g["good_requests"] == 4 and g["slo_ms"] == {"ttft": 2000.0, "e2el": 5000.0}
    assert g["request_goodput"] == pytest.approx(res["metrics"]["request_throughput"])
    assert "Request goodput" in out


def test_json_has_config_metrics_and_requests(bench):
    rc, _, res = bench(
        *SMALL,
        "--num-prompts",
        "5",
        "--api-key",
        "sk-secret",
        "--metric-percentiles",
        "50,95",
        model_name="mock:tag=json",
    )
    assert rc == 0
    assert res["config"]["api_key"] == "<redacted>" and "sk-secret" not in str(res)
    assert res["config"]["num_prompts"] == 5 and res["request_rate"] == "inf"
    assert set(res["metrics"]["ttft"]) == {"mean", "median", "std", "p50", "p95"}
    assert len(res["requests"]) == 5 and res["dataset"]["prompt_len"]["min"] == 32
    assert {"ttft", "itl", "latency", "start", "end", "error", "prompt_len"} <= set(
        res["requests"][0]
    )


def test_multi_turn_resends_growing_history(bench, mock_get):
    name = "mock:tag=mt"
    rc, out, res = bench(
        "--dataset-name",
        "multi-turn",
        "--num-prompts",
        "3",
        "--multi-turn-turns",
        "3",
        "--multi-turn-input-len",
        "20",
        "--multi-turn-output-len",
        "4",
        "--multi-turn-system-len",
        "10",
        "--max-concurrency",
        "2",
        model_name=name,
    )
    assert rc == 0, out
    assert res["metrics"]["completed"] == 9
    seen = mock_get(f"/mock/requests?model={name}")
    sessions: dict[str, list[list[dict]]] = {}
    for s in seen:
        sid = s["headers"]["x-request-id"].split("-")[1]
        sessions.setdefault(sid, []).append(s["body"]["messages"])
    assert len(sessions) == 3
    for turns in sessions.values():
        turns.sort(key=len)
        assert [len(m) for m in turns] == [2, 4, 6]  # system + user, then + assistant + user
        assert turns[0][0]["role"] == "system"
        for prev, cur in itertools.pairwise(turns):
            assert cur[: len(prev)] == prev  # the earlier request is a prefix of the next
            assert cur[len(prev)] == {"role": "assistant", "content": " alpha beta gamma delta"}
    # usage prompt counts grow turn by turn within a session
    by_session: dict[int, list[int]] = {}
    for r in res["requests"]:
        by_session.setdefault(r["session_id"], []).append((r["turn"], r["prompt_len"]))
    for lens in by_session.values():
        p = [n for _, n in sorted(lens)]
        assert p[0] < p[1] < p[2]


def test_multi_turn_failed_turn_skips_the_rest(bench):
    rc, out, res = bench(
        "--dataset-name",
        "multi-turn",
        "--num-prompts",
        "2",
        "--multi-turn-turns",
        "3",
        "--multi-turn-input-len",
        "8",
        "--multi-turn-output-len",
        "3",
        "--max-concurrency",
        "1",
        model_name="mock:fail_every=2",
    )
    assert rc == 0, out
    m = res["metrics"]
    # requests 1 (ok), 2 (fails: session 0 stops), 3 (ok, session 1), 4 (fails)
    assert (m["completed"], m["failed"], m["skipped_turns"]) == (2, 2, 2)


def test_warmup_failure_is_a_clear_error(bench):
    rc, out, _ = bench(
        *SMALL,
        "--num-prompts",
        "2",
        "--num-warmups",
        "1",
        model_name="mock:fail_every=1",
        save=False,
    )
    assert rc == 1 and "warm-up requests failed" in out and "mock failure" in out


def test_sweep_writes_png_and_combined_json(bench_model, mock_url, tmp_path, capsys):
    import json

    from shared.cli import main

    rc = main(
        [
            "bench",
            "--model",
            str(bench_model),
            "--base-url",
            mock_url,
            "--served-model-name",
            "mock:itl=0.005",
            *SMALL,
            "--num-prompts",
            "6",
            "--disable-tqdm",
            "--sweep",
            "50,inf",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "sw.json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    png = (tmp_path / "sw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    combined = json.loads((tmp_path / "sw.json").read_text())
    assert [p["request_rate"] for p in combined["points"]] == [50.0, "inf"]
    assert [p["seed"] for p in combined["points"]] == [0, 1]  # fresh prompts per point
    assert all(p["metrics"]["completed"] == 6 for p in combined["points"])


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--goodput", "ttft=5"), "--goodput"),
        (("--percentile-metrics", "ttft,bogus"), "bogus"),
        (("--metric-percentiles", "50,101"), "[0, 100]"),
        (("--dataset-name", "multi-turn", "--backend", "completions"), "--backend chat"),
        (("--num-prompts", "0"), "--num-prompts"),
        (("--base-url", "127.0.0.1:8000"), "http://"),
        (("--random-range-ratio", "1.5"), "range ratio"),
    ],
)
def test_bad_input_is_a_clear_error(bench, args, needle):
    rc, out, _ = bench(*SMALL, *args, save=False)
    assert rc == 2 and "pdserve bench: error:" in out and needle in out


def test_bad_model_dir_is_a_clear_error(capsys, tmp_path):
    from shared.cli import main

    rc = main(["bench", "--model", str(tmp_path / "nope"), "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a directory" in err

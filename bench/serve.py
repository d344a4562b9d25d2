"""``pdserve bench``: load-test an OpenAI-compatible streaming server, like ``vllm bench serve``.

    pdserve bench --model /models/qwen --base-url http://127.0.0.1:8000 \\
        --dataset-name random --random-input-len 256 --random-output-len 64 \\
        --num-prompts 64 --request-rate inf --ignore-eos --save-result

Metrics are defined as vLLM's client defines them (see ``bench.metrics``), so the two
clients' numbers can be compared directly. ``--sweep 1,2,4,inf`` runs one point per rate and
writes a combined JSON and a throughput-latency PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from bench import datasets as ds
from bench.args import (
    BACKENDS,
    DATASET_ALIASES,
    ENDPOINTS,
    BenchConfigError,
    add_cli_args,
    check_args,
)
from bench.metrics import (
    MetricsError,
    compute_metrics,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)
from bench.report import format_summary, plot_sweep, rate_label, record_dict, write_json
from bench.runner import BenchRunError, LoadConfig, Runner
from bench.tokenizer import BenchTokenizer, TokenizerError

__all__ = ["add_cli_args", "build_dataset", "run", "run_point"]


def build_dataset(
    args: argparse.Namespace, tok: BenchTokenizer, seed: int
) -> tuple[list[ds.Session], ds.DatasetStats]:
    rng = np.random.default_rng(seed)
    name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    if name == "random":
        return ds.random_dataset(
            tok,
            rng,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
        )
    if name == "sharegpt":
        return ds.sharegpt_dataset(
            tok,
            rng,
            args.num_prompts,
            args.sharegpt_input_mean,
            args.sharegpt_output_mean,
            args.sharegpt_sigma,
            args.sharegpt_max_input,
            args.sharegpt_max_total,
            args.sharegpt_output_len,
        )
    if name == "prefix-repetition":
        return ds.prefix_repetition_dataset(
            tok,
            rng,
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
        )
    return ds.multi_turn_dataset(
        tok,
        rng,
        args.num_prompts,
        args.multi_turn_turns,
        args.multi_turn_input_len,
        args.multi_turn_output_len,
        args.multi_turn_range_ratio,
        args.multi_turn_system_len,
    )


def _load_config(args: argparse.Namespace, backend: str, rate: float, seed: int) -> LoadConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    if not base.startswith(("http://", "https://")):
        raise BenchConfigError(f"--base-url must start with http:// or https://, got {base!r}")
    headers = dict(h.split("=", 1) for h in args.header)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers["Content-Type"] = "application/json"
    return LoadConfig(
        url=base.rstrip("/") + (args.endpoint or ENDPOINTS[backend]),
        backend=backend,
        model_name=args.served_model_name or args.model,
        headers=headers,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        request_rate=rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        request_timeout=args.request_timeout,
        think_time=args.multi_turn_think_time,
        seed=seed,
        disable_tqdm=args.disable_tqdm,
    )


def _public_config(args: argparse.Namespace) -> dict:
    cfg = {k: v for k, v in vars(args).items() if not callable(v)}
    if cfg.get("api_key"):
        cfg["api_key"] = "<redacted>"
    cfg["header"] = [h.split("=", 1)[0] + "=<redacted>" for h in args.header]
    return cfg


def _describe(sessions: list[ds.Session], stats: ds.DatasetStats) -> dict:
    ins = [t.prompt_len for s in sessions for t in s.turns]
    outs = [t.output_len for s in sessions for t in s.turns]
    d = {
        "sessions": len(sessions),
        "requests": len(ins),
        "prompt_len": {"mean": float(np.mean(ins)), "min": min(ins), "max": max(ins)},
        "output_len": {"mean": float(np.mean(outs)), "min": min(outs), "max": max(outs)},
        "inexact_prompts": stats.inexact_prompts,
        "prefix_mismatches": stats.prefix_mismatches,
    }
    return d


def run_point(
    args: argparse.Namespace,
    tok: BenchTokenizer,
    backend: str,
    rate: float,
    seed: int,
    metrics: list[str],
    percentiles: list[float],
    slos: dict[str, float],
) -> dict:
    """Build the dataset, run it at ``rate`` and return the results payload (not yet saved)."""
    sessions, stats = build_dataset(args, tok, seed)
    info = _describe(sessions, stats)
    what = "user tokens per turn" if info["requests"] > info["sessions"] else "prompt tokens"
    print(
        f"dataset {args.dataset_name}: {info['requests']} requests in {info['sessions']} "
        f"sessions; {what} mean {info['prompt_len']['mean']:.1f} "
        f"[{info['prompt_len']['min']}, {info['prompt_len']['max']}], "
        f"max_tokens mean {info['output_len']['mean']:.1f}",
        flush=True,
    )
    if stats.inexact_prompts or stats.prefix_mismatches:
        print(
            f"warning: {stats.inexact_prompts} prompts missed their exact token count and "
            f"{stats.prefix_mismatches} do not start with their shared prefix's tokens",
            file=sys.stderr,
        )
    cfg = _load_config(args, backend, rate, seed)
    print(
        f"sending to {cfg.url} at rate {rate_label(rate)}"
        + (f", max concurrency {cfg.max_concurrency}" if cfg.max_concurrency else ""),
        flush=True,
    )
    result = asyncio.run(Runner(cfg, tok).run(sessions))
    m = compute_metrics(
        result.records, result.duration, percentiles, metrics, slos, result.skipped_turns
    )
    title = f"pdserve bench: {args.dataset_name}, rate {rate_label(rate)}"
    print(format_summary(title, m, metrics, percentiles), flush=True)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "backend": backend,
        "url": cfg.url,
        "model": cfg.model_name,
        "request_rate": rate,
        "seed": seed,
        "dataset": info,
        "metrics": m,
        "requests": [record_dict(r, args.save_texts) for r in result.records],
    }


def _stem(args: argparse.Namespace, backend: str, label: str) -> str:
    if args.result_filename:
        return Path(args.result_filename).stem
    model = Path(args.served_model_name or args.model).name or "model"
    when = time.strftime("%Y%m%d-%H%M%S")
    stem = f"pdserve-bench-{backend}-{args.dataset_name}-{label}-{model}-{when}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (BenchConfigError, MetricsError, TokenizerError, ds.DatasetError, BenchRunError) as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2 if not isinstance(e, BenchRunError) else 1
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130


def _raise_fd_limit(connections: int) -> None:
    """Let the process open one socket per concurrent request (plus slack), if the hard limit
    allows; otherwise warn, since running out of descriptors fails requests."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            print(
                f"warning: open-file limit {new} is below the {connections} connections "
                "this run may open; lower --max-concurrency or raise `ulimit -n`",
                file=sys.stderr,
            )


def _run(args: argparse.Namespace) -> int:
    check_args(args)
    metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    name = DATASET_ALIASES.get(args.dataset_name, args.dataset_name)
    backend = (
        BACKENDS[args.backend]
        if args.backend
        else ("chat" if name == "multi-turn" else "completions")
    )
    if name == "multi-turn" and backend != "chat":
        raise BenchConfigError(
            "--dataset-name multi-turn resends the chat history: use --backend chat"
        )
    tok = BenchTokenizer.from_dir(args.tokenizer or args.model)
    _raise_fd_limit(args.max_concurrency or args.num_prompts)
    out_dir = Path(args.result_dir)
    if args.sweep is None:
        payload = run_point(
            args, tok, backend, args.request_rate, args.seed, metrics, percentiles, slos
        )
        payload["config"] = _public_config(args)
        if args.save_result:
            path = out_dir / (_stem(args, backend, rate_label(args.request_rate)) + ".json")
            print(f"results written to {write_json(path, payload)}")
        return 0 if payload["metrics"]["completed"] else 1
    # A sweep: fresh prompts per point (seed + i) so a server's prefix cache cannot carry over.
    for m in ("ttft", "tpot", "itl"):
        if m not in metrics:
            metrics.append(m)
    if 99.0 not in percentiles:
        percentiles.append(99.0)
    points = []
    for i, rate in enumerate(args.sweep):
        points.append(
            run_point(args, tok, backend, rate, args.seed + i, metrics, percentiles, slos)
        )
    stem = _stem(args, backend, "sweep")
    combined = {"config": _public_config(args), "points": points}
    print(f"sweep results written to {write_json(out_dir / (stem + '.json'), combined)}")
    title = (
        f"{args.served_model_name or Path(args.model).name}, {args.dataset_name}, "
        f"{backend}, {args.num_prompts} prompts per point"
    )
    png = plot_sweep(
        [(p["request_rate"], p["metrics"]) for p in points], out_dir / (stem + ".png"), title
    )
    print(f"sweep plot written to {png}")
    return 0 if any(p["metrics"]["completed"] for p in points) else 1

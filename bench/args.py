"""Command-line arguments of ``pdserve bench`` and their validation (no I/O here)."""

from __future__ import annotations

import argparse
import json
import math

from bench import datasets as ds
from bench.metrics import DEFAULT_PERCENTILE_METRICS, DEFAULT_PERCENTILES

DATASETS = ("random", "sharegpt", "prefix-repetition", "multi-turn")
DATASET_ALIASES = {
    "prefix_repetition": "prefix-repetition",
    "shared-prefix": "prefix-repetition",
    "multi_turn": "multi-turn",
}
BACKENDS = {
    "completions": "completions",
    "openai": "completions",
    "chat": "chat",
    "openai-chat": "chat",
}
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchConfigError(ValueError):
    """Bad command-line input."""


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        v = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number or 'inf')") from e
    if not v > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or 'inf', got {text!r}")
    return v


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return v


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to options that have a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if not (d is None or d is False or d == [] or d == argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _HelpFormatter
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000; overrides host/port")
    g.add_argument("--host", default="127.0.0.1", help="server host")
    g.add_argument("--port", type=int, default=8000, help="server port")
    g.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        help="completions (alias openai) or chat (alias openai-chat); if not given, "
        "completions, or chat for --dataset-name multi-turn",
    )
    g.add_argument("--endpoint", help="path; if not given /v1/completions or /v1/chat/completions")
    g.add_argument(
        "--api-key",
        help="sent as 'Authorization: Bearer KEY'; if not given, $OPENAI_API_KEY when set",
    )
    g.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra HTTP header (repeatable)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        required=True,
        help="local Hugging Face model directory; its tokenizer builds the prompts",
    )
    g.add_argument("--tokenizer", help="tokenizer directory, if not the --model one")
    g.add_argument("--served-model-name", help="the 'model' field sent; if not given, --model")
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=list(DATASETS) + sorted(DATASET_ALIASES),
        help="sharegpt is synthetic (log-normal lengths, no download)",
    )
    g.add_argument(
        "--num-prompts", type=int, default=1000, help="requests to send (multi-turn: sessions)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    g.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt tokens as the server counts them (BOS included)",
    )
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="both lengths uniform in [L*(1-r), L*(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one prefix shared by all prompts, before the random part",
    )
    g.add_argument(
        "--sharegpt-input-mean",
        type=float,
        default=ds.SHAREGPT_INPUT_MEAN,
        help="mean prompt tokens of the log-normal",
    )
    g.add_argument(
        "--sharegpt-output-mean",
        type=float,
        default=ds.SHAREGPT_OUTPUT_MEAN,
        help="mean output tokens of the log-normal",
    )
    g.add_argument(
        "--sharegpt-sigma",
        type=float,
        default=ds.SHAREGPT_SIGMA,
        help="sigma of the underlying normal, both lengths",
    )
    g.add_argument(
        "--sharegpt-max-input",
        type=int,
        default=ds.SHAREGPT_MAX_INPUT,
        help="longer prompts are redrawn",
    )
    g.add_argument(
        "--sharegpt-max-total",
        type=int,
        default=ds.SHAREGPT_MAX_TOTAL,
        help="pairs with longer prompt + output are redrawn",
    )
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of drawn")
    g.add_argument(
        "--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix"
    )
    g.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="tokens after the prefix, unique per request",
    )
    g.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="distinct prefixes, used round-robin, order shuffled",
    )
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max_tokens")
    g.add_argument("--multi-turn-turns", type=int, default=4, help="user turns per session")
    g.add_argument("--multi-turn-input-len", type=int, default=128, help="user tokens per turn")
    g.add_argument("--multi-turn-output-len", type=int, default=64, help="max_tokens per turn")
    g.add_argument(
        "--multi-turn-range-ratio",
        type=float,
        default=0.0,
        help="per-turn lengths uniform in [L*(1-r), L*(1+r)]",
    )
    g.add_argument(
        "--multi-turn-system-len",
        type=int,
        default=0,
        help="tokens of a system message shared by all sessions",
    )
    g.add_argument(
        "--multi-turn-think-time",
        type=float,
        default=0.0,
        help="seconds between an answer and the next turn",
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="sent with every request")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM/SGLang extension) so outputs reach max_tokens",
    )
    g.add_argument("--extra-body", type=_json_object, help="JSON object merged into every request")
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="arrivals per second (multi-turn: sessions); inf = all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps; 1 = Poisson, < 1 burstier",
    )
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    g.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="untimed requests sent first; any failure aborts the run",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request (stream included) may take",
    )
    g.add_argument(
        "--sweep",
        type=_rates,
        metavar="RATES",
        help="comma list of rates (e.g. 1,2,4,inf): one run each with seed+i, then a "
        "combined JSON and a PNG in --result-dir",
    )
    g = p.add_argument_group("metrics and output")
    g.add_argument(
        "--percentile-metrics",
        default=DEFAULT_PERCENTILE_METRICS,
        help="which of ttft,tpot,itl,e2el to report",
    )
    g.add_argument("--metric-percentiles", default=DEFAULT_PERCENTILES, help="comma list")
    g.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="SLOs in ms for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--save-result", action="store_true", help="write the JSON results")
    g.add_argument("--save-texts", action="store_true", help="include generated texts in the JSON")
    g.add_argument("--result-dir", default=".", help="where JSON (and sweep PNG) files go")
    g.add_argument(
        "--result-filename",
        help="JSON file name; a sweep's PNG takes the same stem; if not given, "
        "named after backend, dataset, rate, model and time",
    )


def check_args(args: argparse.Namespace) -> None:
    positive = {
        "--num-prompts": args.num_prompts,
        "--max-concurrency": args.max_concurrency or 1,
        "--multi-turn-turns": args.multi_turn_turns,
    }
    for name, v in positive.items():
        if v < 1:
            raise BenchConfigError(f"{name} must be >= 1, got {v}")
    if args.num_warmups < 0:
        raise BenchConfigError("--num-warmups must be >= 0")
    for name, v in (("--burstiness", args.burstiness), ("--request-timeout", args.request_timeout)):
        if not v > 0:
            raise BenchConfigError(f"{name} must be > 0, got {v}")
    for h in args.header:
        if "=" not in h:
            raise BenchConfigError(f"--header expects KEY=VALUE, got {h!r}")
    if args.sweep is not None and not args.sweep:
        raise BenchConfigError("--sweep needs at least one rate")

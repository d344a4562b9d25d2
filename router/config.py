"""Router configuration: the ``pdserve router`` flags and the frozen config built from them."""

from __future__ import annotations

import argparse
import logging
import math
import os
import ssl
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import cast

from router.policy import PolicyConfig
from router.tool_calls import TOOL_CALL_PARSERS, ToolSettings
from shared.config import int_at_least, parse_bytes, port_number
from shared.directory import DEFAULT_PREFIX
from shared.security import ClusterSecurity

logger = logging.getLogger(__name__)
# the environment variables read for API keys (comma-separated), in this order
API_KEY_ENV = ("PDSERVE_API_KEY", "VLLM_API_KEY")
_CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


def _addresses(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"worker address {a!r} is not host:port")
    return out


def _check_key(key: str, where: str) -> None:
    """A key must be sendable as a Bearer token: printable ASCII, no spaces (the message
    never contains the key)."""
    if not key:
        raise ValueError(f"{where}: empty API key")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(
            f"{where}: an API key may hold only printable ASCII characters without spaces"
        )


def read_api_key_file(path: str) -> tuple[str, ...]:
    """The keys in ``path``: one a line; blank lines and lines starting with ``#`` are
    skipped, surrounding whitespace is stripped. Raises ValueError if the file cannot be read
    or holds no key."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"--api-key-file {path}: cannot read it: {reason}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"--api-key-file {path}: not a regular file")
    keys = []
    for n, line in enumerate(lines, 1):
        key = line.strip()
        if key and not key.startswith("#"):
            _check_key(key, f"--api-key-file {path}, line {n}")
            keys.append(key)
    if not keys:
        raise ValueError(
            f"--api-key-file {path}: no key in it (one key per line; blank lines and "
            "lines starting with # are ignored)"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "--api-key-file %s can be read by other users (mode %03o): chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return tuple(keys)


def collect_api_keys(
    cli: Iterable[str] | None,
    files: Iterable[str] | None,
    environ: Mapping[str, str],
) -> tuple[str, ...]:
    """All configured keys, merged and de-duplicated in order: ``--api-key``, then
    ``--api-key-file``s, then ``$PDSERVE_API_KEY`` and ``$VLLM_API_KEY`` (comma-separated;
    an empty variable means no key from it)."""
    keys: list[str] = []
    for key in cli or ():
        _check_key(key, "--api-key")
        keys.append(key)
    for path in files or ():
        keys.extend(read_api_key_file(path))
    for var in API_KEY_ENV:
        for key in (k.strip() for k in environ.get(var, "").split(",")):
            if key:
                _check_key(key, f"${var}")
                keys.append(key)
    return tuple(dict.fromkeys(keys))


def check_tls_files(config: RouterConfig) -> None:
    """Loads the certificate chain and CA file the way the server will, so a wrong path,
    an unreadable file or a key that does not match the certificate is a clear start-up
    error instead of a traceback from uvicorn. Raises ValueError."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for flag, path in (
        ("--ssl-certfile", config.ssl_certfile),
        ("--ssl-keyfile", config.ssl_keyfile),
    ):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path}: not a readable file")
    try:
        ctx.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: "
            f"cannot load the certificate and its key ({e})"
        ) from None
    if config.ssl_ca_certs is not None:
        path = config.ssl_ca_certs
        if not os.access(path, os.R_OK):
            raise ValueError(f"--ssl-ca-certs {path}: not readable")
        try:
            ctx.load_verify_locations(path)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {path}: cannot load it ({e})") from None


@dataclass(frozen=True)
class RouterConfig:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_model_len: int | None = None
    tools: ToolSettings = field(default_factory=ToolSettings)  # tool calling (vLLM's flags)
    redis_url: str | None = None
    directory_prefix: str = DEFAULT_PREFIX
    decode_workers: tuple[str, ...] = ()
    prefill_workers: tuple[str, ...] = ()
    block_size: int = 16  # for static workers the registry does not describe
    host: str = "0.0.0.0"
    port: int = 8000
    # an inherited listening socket to serve on instead of binding host:port (``pdserve up``
    # holds the router's port from its start, so that no worker's ephemeral port takes it)
    fd: int | None = None
    # the accepted API keys (empty: no authentication); never in repr() or a log line. A
    # single str is taken as one key (older callers), None as none
    api_key: tuple[str, ...] = field(default=(), repr=False)
    disable_metrics_auth: bool = False  # /metrics open (like /health) even with keys set
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE
    security: ClusterSecurity = field(default_factory=ClusterSecurity)  # cluster secret, gRPC TLS
    request_timeout_s: float = 600.0
    max_retries: int = 2
    stall_timeout_s: float = 60.0
    worker_stall_timeout_s: float = 10.0  # a silent GenerateMux call fails (0: off)
    decode_stream: str = "mux"  # "mux" (one GenerateMux call per worker) | "per-request"
    max_inflight_requests: int = 0
    max_waiting_per_worker: int = 0
    max_request_body_bytes: int = 1 << 20
    worker_refresh_interval_s: float = 0.5
    worker_cooldown_s: float = 5.0
    directory_timeout_s: float = 0.1
    directory_sweep_interval_s: float = 60.0
    directory_lookup: str = "mirror"
    max_logprobs: int = 20
    max_n: int = 128
    max_prompts_per_request: int = 256
    max_choices_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_chars: int = 8192
    max_cache_salt_length: int = 256
    max_json_depth: int = 64
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    uvicorn_log_level: str = "info"
    access_log: bool = True
    shutdown_timeout_s: float = 10.0

    @property
    def name(self) -> str:
        """The model name clients send and the block-hash seed (same as the workers')."""
        return self.served_model_name or self.model

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def __post_init__(self) -> None:
        raw: object = self.api_key
        if raw is None:
            raw = ()
        elif isinstance(raw, str):
            raw = (raw,)
        if not isinstance(raw, (tuple, list)) or not all(isinstance(k, str) for k in raw):
            raise ValueError("api_key must be a tuple of strings")
        keys = tuple(dict.fromkeys(cast("list[str]", raw)))
        for n, key in enumerate(keys, 1):
            _check_key(key, f"API key #{n}")
        object.__setattr__(self, "api_key", keys)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile must be given together")
        if self.ssl_certfile is None and self.ssl_ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        if self.ssl_cert_reqs not in _CERT_REQS:
            raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
        if self.ssl_cert_reqs != ssl.CERT_NONE and self.ssl_ca_certs is None:
            raise ValueError(
                "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CA that signs client certificates)"
            )
        if not self.redis_url and not self.decode_workers:
            raise ValueError("give --redis-url (worker discovery) or --decode-workers (static)")
        # inf / nan pass every "> 0" check below: a "no timeout" --request-timeout inf went to
        # the workers as an infinite deadline, which they refuse (every request a 400)
        for owner in (self, self.policy):
            for f in fields(owner):
                v = getattr(owner, f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    flag = "--" + f.name.removesuffix("_s").replace("_", "-")
                    raise ValueError(f"{flag} must be a finite number, not {v}")
        if self.request_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("--request-timeout and --stall-timeout must be positive")
        if self.worker_stall_timeout_s < 0:
            raise ValueError("--worker-stall-timeout must be >= 0 (0 = off)")
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        for flag, v in (
            ("--max-n", self.max_n),
            ("--max-logprobs", self.max_logprobs + 1),
            ("--max-prompts-per-request", self.max_prompts_per_request),
            ("--max-choices-per-request", self.max_choices_per_request),
            ("--max-stop-strings", self.max_stop_strings + 1),
            ("--max-stop-chars", self.max_stop_chars + 1),
            ("--max-cache-salt-length", self.max_cache_salt_length),
            ("--max-json-depth", self.max_json_depth),
            ("--max-request-body", self.max_request_body_bytes),
        ):
            if v < 1:
                raise ValueError(f"{flag} is too small")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        ClusterSecurity.add_cli_args(parser)
        g = parser.add_argument_group("model")
        g.add_argument(
            "--model",
            required=True,
            help="Hugging Face model directory (tokenizer, chat template, config.json)",
        )
        g.add_argument(
            "--served-model-name",
            default=None,
            help="name in the API; must equal the workers' (default: --model)",
        )
        g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
        g.add_argument("--chat-template", default=None, help="chat template file or inline text")
        g.add_argument(
            "--trust-request-chat-template",
            action="store_true",
            help="let a request bring its own chat_template (without it such a request is "
            "refused with 400, as in vLLM); a template runs as Python-like code in the router, "
            "so only for trusted clients",
        )
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help="parse tool calls from the model's output for tool_choice 'auto' "
            "(needs --tool-call-parser)",
        )
        g.add_argument(
            "--tool-call-parser",
            default=None,
            choices=TOOL_CALL_PARSERS,
            help="the model's tool-call format: hermes (<tool_call> JSON, Qwen2.5 / Hermes / "
            "the test models) or llama3_json (Llama 3.x JSON)",
        )
        g.add_argument(
            "--exclude-tools-when-tool-choice-none",
            action="store_true",
            help="do not render the tools into the prompt when tool_choice is 'none'",
        )
        g = parser.add_argument_group("workers")
        g.add_argument(
            "--redis-url",
            default=os.environ.get("PDSERVE_REDIS_URL"),
            help="worker registry and prefix directory (env PDSERVE_REDIS_URL)",
        )
        g.add_argument("--directory-prefix", default=DEFAULT_PREFIX)
        g.add_argument(
            "--decode-workers",
            type=_addresses,
            default=(),
            help="static decode workers host:port,... (overrides discovery)",
        )
        g.add_argument(
            "--prefill-workers",
            type=_addresses,
            default=(),
            help="static prefill workers host:port,... (overrides discovery)",
        )
        g.add_argument(
            "--block-size",
            type=int,
            default=16,
            help="block size of static workers missing from the registry",
        )
        g.add_argument("--worker-refresh-interval", type=float, default=0.5, help="seconds")
        g.add_argument(
            "--worker-cooldown",
            type=float,
            default=5.0,
            help="seconds a failed worker is kept out of routing",
        )
        g = parser.add_argument_group("routing")
        d = PolicyConfig()
        g.add_argument(
            "--local-prefill-threshold",
            type=int,
            default=d.local_prefill_threshold,
            help="prefill on the decode worker when it lacks at most this many prompt "
            "tokens (conditional disaggregation)",
        )
        g.add_argument(
            "--transfer-cost",
            type=float,
            default=d.transfer_cost,
            help="cost of moving one token of KV to the decode worker, in prefill tokens",
        )
        g.add_argument(
            "--local-prefill-penalty",
            type=float,
            default=d.local_prefill_penalty,
            help="cost of one token prefilled on a decode worker, in prefill tokens",
        )
        g.add_argument(
            "--idle-local-prefill-tokens",
            type=int,
            default=d.idle_local_prefill_tokens,
            help="a decode worker with nothing in flight prefills a prompt it lacks at most "
            "this many tokens of at a prefill worker's cost (no transfer, no batch to stall); "
            "0: it costs the local-prefill penalty like on a busy one",
        )
        g.add_argument(
            "--decode-stall-cost",
            type=float,
            default=d.decode_stall_cost,
            help="extra local-prefill cost per token, as a fraction of the penalty, for "
            "each request the decode worker is already decoding",
        )
        g.add_argument(
            "--directory-timeout",
            type=float,
            default=0.1,
            help="seconds; past it, route on load alone",
        )
        g.add_argument(
            "--directory-lookup",
            choices=("mirror", "redis"),
            default="mirror",
            help="where a request's prefix lookup reads the directory: 'mirror', the router's "
            "own copy kept current from the directory's event stream (no round trip; asks "
            "Redis while the copy loads), or 'redis', one round trip per request",
        )
        g.add_argument(
            "--directory-sweep-interval",
            type=float,
            default=60.0,
            help="seconds between stale-entry sweeps of the directory (0 = off)",
        )
        g = parser.add_argument_group("server")
        g.add_argument("--host", default="0.0.0.0")
        g.add_argument("--port", type=port_number, default=8000)
        g.add_argument(
            "--fd",
            type=int_at_least(0),
            default=None,
            help="serve on this inherited listening socket instead of binding --host/--port "
            "(as uvicorn's --fd; pdserve up passes the port it holds this way)",
        )
        g.add_argument(
            "--request-timeout",
            type=float,
            default=600.0,
            help="seconds a request may take end to end",
        )
        g.add_argument(
            "--stall-timeout",
            type=float,
            default=60.0,
            help="seconds without output before a decode worker counts as failed",
        )
        g.add_argument(
            "--worker-stall-timeout",
            type=float,
            default=10.0,
            help="seconds a decode worker's GenerateMux call may go without any message "
            "(its heartbeats come every second from its event loop) while requests are on "
            "it; past that its event loop counts as stuck and every request on the call "
            "fails over (0 = off; workers that send no heartbeats are never timed out)",
        )
        g.add_argument(
            "--decode-stream",
            choices=("mux", "per-request"),
            default="mux",
            help="how tokens come back from a decode worker: mux (one GenerateMux call per "
            "worker carries every request's outputs, one message per engine step) or "
            "per-request (one Generate call per request, one message per request per step)",
        )
        g.add_argument(
            "--max-retries", type=int, default=2, help="re-routes per request after worker failures"
        )
        g.add_argument(
            "--max-inflight-requests",
            type=int,
            default=0,
            help="429 beyond this many requests in flight (0 = unlimited)",
        )
        g.add_argument(
            "--max-waiting-per-worker",
            type=int,
            default=0,
            help="429 when every decode worker has this many waiting (0 = off)",
        )
        g = parser.add_argument_group(
            "authentication and TLS",
            "with any API key configured, every route but /health and /ping needs one: "
            "'Authorization: Bearer KEY', or HTTP Basic auth with the key as the password "
            "(any user name; the browser asks for it on /dashboard). Keys from all sources "
            "are merged",
        )
        g.add_argument(
            "--api-key",
            nargs="+",
            action="extend",
            default=None,
            metavar="KEY",
            help="accepted API key(s). Prefer $PDSERVE_API_KEY / $VLLM_API_KEY "
            "(comma-separated) or --api-key-file: a flag's value is visible to every "
            "user on the host in `ps`",
        )
        g.add_argument(
            "--api-key-file",
            action="append",
            default=None,
            metavar="PATH",
            help="file of accepted API keys, one a line; blank lines and lines starting "
            "with # are ignored (keep it chmod 600). May be repeated",
        )
        g.add_argument(
            "--disable-metrics-auth",
            action="store_true",
            help="serve /metrics without a key (like /health), for a scraper that cannot "
            "send 'Authorization: Bearer KEY' (Prometheus can: authorization: "
            "{credentials: KEY}). The metrics then show request counts and model names "
            "to anyone who can reach the port",
        )
        g.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="TLS private key (PEM)")
        g.add_argument(
            "--ssl-certfile",
            default=None,
            metavar="PATH",
            help="TLS certificate chain (PEM); with --ssl-keyfile, serve HTTPS",
        )
        g.add_argument(
            "--ssl-ca-certs",
            default=None,
            metavar="PATH",
            help="CA certificates (PEM) that client certificates must chain to",
        )
        g.add_argument(
            "--ssl-cert-reqs",
            type=int,
            default=int(ssl.CERT_NONE),
            choices=_CERT_REQS,
            help="client certificates: 0 = not asked for, 1 = checked if sent, "
            "2 = required (mutual TLS; needs --ssl-ca-certs)",
        )
        g = parser.add_argument_group(
            "request limits",
            "what one request may ask for; beyond them it gets a 400 (413 for "
            "the body) naming the parameter",
        )
        g.add_argument(
            "--max-request-body",
            default="1MiB",
            help="413 above this body size. JSON parsing and validation hold the "
            "event loop: about 50 ms per MiB at worst on a 2-core CPU, so the "
            "default keeps /health within 100 ms; 1 MiB holds a prompt of about "
            "140k token ids or 250k tokens of text. Raise it for longer contexts",
        )
        g.add_argument(
            "--max-logprobs",
            type=int,
            default=20,
            help="most top logprobs per token (vLLM's --max-logprobs)",
        )
        g.add_argument("--max-n", type=int, default=128, help="most samples per prompt (n)")
        g.add_argument(
            "--max-prompts-per-request",
            type=int,
            default=256,
            help="most prompts in one /v1/completions request",
        )
        g.add_argument(
            "--max-choices-per-request",
            type=int,
            default=1024,
            help="most choices (prompts x n) in one request",
        )
        g.add_argument(
            "--max-stop-strings",
            type=int,
            default=64,
            help="most stop strings (and stop_token_ids) per request",
        )
        g.add_argument(
            "--max-stop-chars",
            type=int,
            default=8192,
            help="most characters in all stop strings of a request together",
        )
        g.add_argument(
            "--max-cache-salt-length", type=int, default=256, help="most characters in cache_salt"
        )
        g.add_argument(
            "--max-json-depth",
            type=int,
            default=64,
            help="deepest nesting of lists / objects in tools, tool calls, message "
            "parts, response_format and unknown fields",
        )
        g.add_argument(
            "--uvicorn-log-level",
            default="info",
            choices=("critical", "error", "warning", "info", "debug", "trace"),
        )
        g.add_argument("--disable-uvicorn-access-log", action="store_true")
        g.add_argument(
            "--shutdown-timeout",
            type=float,
            default=10.0,
            help="seconds SIGTERM waits for in-flight requests before closing them; "
            "the router's own clean-up after that is bounded by 5 s",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RouterConfig:
        return cls(
            model=ns.model,
            served_model_name=ns.served_model_name,
            tokenizer=ns.tokenizer,
            chat_template=ns.chat_template,
            trust_request_chat_template=ns.trust_request_chat_template,
            max_model_len=ns.max_model_len,
            tools=ToolSettings(
                ns.enable_auto_tool_choice,
                ns.tool_call_parser,
                ns.exclude_tools_when_tool_choice_none,
            ),
            redis_url=ns.redis_url,
            directory_prefix=ns.directory_prefix,
            decode_workers=tuple(ns.decode_workers),
            prefill_workers=tuple(ns.prefill_workers),
            block_size=ns.block_size,
            host=ns.host,
            port=ns.port,
            fd=ns.fd,
            api_key=collect_api_keys(ns.api_key, ns.api_key_file, os.environ),
            disable_metrics_auth=ns.disable_metrics_auth,
            ssl_keyfile=ns.ssl_keyfile,
            ssl_certfile=ns.ssl_certfile,
            ssl_ca_certs=ns.ssl_ca_certs,
            ssl_cert_reqs=ns.ssl_cert_reqs,
            security=ClusterSecurity.from_cli_args(ns),
            request_timeout_s=ns.request_timeout,
            max_retries=ns.max_retries,
            stall_timeout_s=ns.stall_timeout,
            worker_stall_timeout_s=ns.worker_stall_timeout,
            decode_stream=ns.decode_stream,
            max_inflight_requests=ns.max_inflight_requests,
            max_waiting_per_worker=ns.max_waiting_per_worker,
            max_request_body_bytes=parse_bytes(ns.max_request_body),
            worker_refresh_interval_s=ns.worker_refresh_interval,
            worker_cooldown_s=ns.worker_cooldown,
            directory_timeout_s=ns.directory_timeout,
            directory_sweep_interval_s=ns.directory_sweep_interval,
            directory_lookup=ns.directory_lookup,
            max_logprobs=ns.max_logprobs,
            max_n=ns.max_n,
            max_prompts_per_request=ns.max_prompts_per_request,
            max_choices_per_request=ns.max_choices_per_request,
            max_stop_strings=ns.max_stop_strings,
            max_stop_chars=ns.max_stop_chars,
            max_cache_salt_length=ns.max_cache_salt_length,
            max_json_depth=ns.max_json_depth,
            policy=PolicyConfig(
                local_prefill_threshold=ns.local_prefill_threshold,
                transfer_cost=ns.transfer_cost,
                local_prefill_penalty=ns.local_prefill_penalty,
                idle_local_prefill_tokens=ns.idle_local_prefill_tokens,
                decode_stall_cost=ns.decode_stall_cost,
            ),
            uvicorn_log_level=ns.uvicorn_log_level,
            access_log=not ns.disable_uvicorn_access_log,
            shutdown_timeout_s=ns.shutdown_timeout,
        )

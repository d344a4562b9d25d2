"""The ``pdserve`` console script.

Each subcommand lives in its own module, imported only when that subcommand runs, so
``pdserve router`` never imports torch. A subcommand module provides
``add_cli_args(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "shared.cli.launcher",
        "start a whole local cluster: Redis, router, prefill and decode workers",
    ),
    "router": ("router.server", "run the OpenAI-compatible router"),
    "prefill": ("prefill_service.server", "run a prefill worker"),
    "decode": ("decode_service.server", "run a decode worker"),
    "bench": ("bench.serve", "load-test an OpenAI-compatible server"),
    "fuzz": ("bench.fuzz", "send hostile requests to a running cluster and check it survives"),
    "chaos": (
        "bench.chaos",
        "faults under load (kill -9, SIGSTOP, Redis down, slow clients) and a soak",
    ),
    "make-tiny-model": (
        "shared.cli.tiny_model",
        "write a small random-weight Hugging Face model directory",
    ),
    "quantize": (
        "shared.cli.quantize",
        "write a quantized copy of a dense checkpoint (AWQ, GPTQ, compressed-tensors layouts)",
    ),
}

# the processes `pdserve up` may pin to CPUs of their own (shared/cpu_bind.py)
BOUND_COMMANDS = ("router", "prefill", "decode")


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only import the module that will run
            importlib.import_module(module).add_cli_args(p)
    return parser, chosen if chosen in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, chosen = build_parser(argv)
    args = parser.parse_args(argv)
    if chosen is None:
        parser.print_help()
        return 2
    if chosen in BOUND_COMMANDS:  # before any thread starts: every later one inherits it
        from shared.cpu_bind import bind_from_env

        bind_from_env()
    module = importlib.import_module(SUBCOMMANDS[chosen][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

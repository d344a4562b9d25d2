"""Counts and ports on the command lines are checked where they are parsed: a negative worker
count or a port past 65535 is the usual one-line ``argument --x`` error (exit 2), not a cluster
started with nonsense (``pdserve up --prefill -1`` used to start and serve) or a traceback
from ``bind()`` (``--port 70000``)."""

from __future__ import annotations

import argparse

import pytest

from router.config import RouterConfig
from shared.cli.launcher import cluster_args
from shared.config import ConfigError, EngineArgs
from shared.worker.service import add_worker_cli_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "argument --port: 70000 is not a port number (0 to 65535)"),
        (["--port", "-1"], "argument --port: -1 is not a port number"),
        (["--port", "http"], "argument --port: 'http' is not a port number"),
        (["--prefill", "-1"], "argument --prefill: -1 is below 0"),
        (["--decode", "0"], "argument --decode: 0 is below 1"),
        (["--threads-per-worker", "0"], "argument --threads-per-worker: 0 is below 1"),
        (["--decode", "two"], "argument --decode: 'two' is not an integer"),
    ],
)
def test_pdserve_up_refuses_bad_numbers(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cluster_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_pdserve_up_takes_the_edges():
    a = cluster_args(["--port", "0", "--prefill", "0", "--decode", "1"])
    assert (a.port, a.prefill, a.decode) == (0, 0, 1)
    assert cluster_args(["--port", "65535"]).port == 65535


def test_router_and_worker_ports_are_checked(capsys):
    p = argparse.ArgumentParser()
    RouterConfig.add_cli_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--port", "65536"])
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--fd", "-3"])
    assert "--fd: -3 is below 0" in capsys.readouterr().err
    w = argparse.ArgumentParser()
    add_worker_cli_args(w, "decode")
    with pytest.raises(SystemExit):
        w.parse_args(["--model", "m", "--metrics-port", "100000"])
    assert "--metrics-port: 100000 is not a port number" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--restart-backoff", "-1"], ["--restart-backoff", "nan"]])
def test_a_negative_or_nan_restart_backoff_is_refused(argv, capsys):
    """A negative backoff was accepted: a crashing child restarted with no pause at all."""
    with pytest.raises(SystemExit):
        cluster_args(argv)
    assert "argument --restart-backoff" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--max-model-len", "max_model_len"),
        ("--max-num-seqs", "max_num_seqs"),
        ("--max-num-batched-tokens", "max_num_batched_tokens"),
    ],
)
def test_zero_engine_sizes_are_an_error_not_the_default(flag, field, tiny_llama):
    """0 had silently meant the default (``x or default``): ``pdserve up --max-num-seqs 0``
    started a cluster with 128 sequences a step."""
    args = EngineArgs(model=str(tiny_llama), **{field: 0})
    with pytest.raises(ConfigError, match=f"{flag} 0: must be positive"):
        mc = args.create_model_config()
        args.create_scheduler_config(mc, "cpu")


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("request_timeout_s", float("inf"), "--request-timeout"),
        ("request_timeout_s", float("nan"), "--request-timeout"),
        ("worker_cooldown_s", float("inf"), "--worker-cooldown"),
    ],
)
def test_the_router_refuses_a_duration_that_is_not_finite(field, value, flag):
    """``--request-timeout inf`` (a "no timeout") passed the > 0 check and went to the workers
    as an infinite deadline, which they refuse: every request answered 400; nan made every
    deadline 1 ms (found by review)."""
    with pytest.raises(ValueError, match=f"{flag} must be a finite number"):
        RouterConfig(model="m", decode_workers=("127.0.0.1:1",), **{field: value})


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--kv-transfer-timeout", "0"),
        ("--kv-transfer-timeout", "-1"),
        ("--kv-transfer-timeout", "inf"),
        ("--engine-hang-timeout", "nan"),
        ("--drain-timeout", "-5"),
    ],
)
def test_worker_durations_are_checked_where_they_are_parsed(flag, value, capsys):
    """A zero, negative or infinite ``--kv-transfer-timeout`` started a worker whose every
    transfer raised ValueError: each request fell back to a local prefill, disaggregation off
    with one warning per request (found by review)."""
    w = argparse.ArgumentParser()
    add_worker_cli_args(w, "decode")
    with pytest.raises(SystemExit):
        w.parse_args(["--model", "m", flag, value])
    assert f"argument {flag}" in capsys.readouterr().err

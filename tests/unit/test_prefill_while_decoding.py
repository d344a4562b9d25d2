"""``--max-prefill-tokens-while-decoding``: how the flag resolves, and ``pdserve up`` giving it
to a disaggregated cluster's decode workers only (docs/benchmarks.md, "Local prefills on a
decode worker"). The scheduler's side is in ``test_scheduler.py``."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from decode_service.server import add_cli_args as decode_cli_args
from shared.cli import launcher
from shared.cli.launcher import DISAGG_DECODE_PREFILL_SHARE, cluster_args
from shared.config import ConfigError, EngineArgs
from shared.cpu_bind import BIND_ENV

pytestmark = pytest.mark.unit

MODEL = SimpleNamespace(max_model_len=4096)


@pytest.mark.parametrize(
    "value,budget,room",
    [(None, None, 0), (0, None, 0), (0.5, None, 1024), (0.5, 512, 256), (300, 2048, 300)],
)
def test_the_flag_is_tokens_or_a_fraction_of_the_step_budget(value, budget, room):
    args = EngineArgs(
        model="m", max_prefill_tokens_while_decoding=value, max_num_batched_tokens=budget
    )
    cfg = args.create_scheduler_config(MODEL, "cpu")
    assert cfg.max_prefill_tokens_while_decoding == room


@pytest.mark.parametrize("value", [-1, 1.5, float("nan"), float("inf")])
def test_a_bad_value_is_a_config_error(value):
    with pytest.raises(ConfigError, match="max-prefill-tokens-while-decoding"):
        EngineArgs(model="m", max_prefill_tokens_while_decoding=value).create_scheduler_config(
            MODEL, "cpu"
        )


def _decode_value(argv: list[str]) -> float | None:
    """The value a decode worker started with ``argv`` reads (the last flag wins)."""
    p = argparse.ArgumentParser()
    decode_cli_args(p)
    return p.parse_args(argv[1:]).max_prefill_tokens_while_decoding


def _spawned(monkeypatch, argv: list[str]) -> dict:
    monkeypatch.setenv(BIND_ENV, "nobind")
    monkeypatch.setattr(launcher, "usable_cores", lambda: 8)
    cluster = launcher.Cluster.__new__(launcher.Cluster)
    cluster.args = cluster_args(["--model", "m", *argv])
    spawned: dict = {}
    monkeypatch.setattr(cluster, "start_redis", lambda: "redis://127.0.0.1:1")
    monkeypatch.setattr(
        cluster, "_spawn", lambda name, argv, threads, env=None: spawned.setdefault(name, argv)
    )
    for i in range(cluster.args.prefill):
        cluster.spawn_worker("prefill", i)
    cluster.spawn_worker("decode", 0)
    return spawned


@pytest.mark.parametrize(
    "argv,decode_value",
    [
        (["--prefill", "1"], DISAGG_DECODE_PREFILL_SHARE),
        (["--prefill", "2", "--decode", "2"], DISAGG_DECODE_PREFILL_SHARE),
        (["--prefill", "0"], None),  # colocated: every prompt is the worker's own
        (["--prefill", "1", "--max-prefill-tokens-while-decoding", "0"], 0),  # told otherwise
        (["--prefill", "1", "--decode-arg=--max-prefill-tokens-while-decoding=256"], 256),
    ],
)
def test_pdserve_up_bounds_the_prefills_of_a_disaggregated_clusters_decode_workers(
    monkeypatch, argv, decode_value
):
    spawned = _spawned(monkeypatch, argv)
    assert _decode_value(spawned["decode-0"]) == decode_value
    if "prefill-0" in spawned and decode_value == DISAGG_DECODE_PREFILL_SHARE:
        assert "--max-prefill-tokens-while-decoding" not in spawned["prefill-0"]

"""Flags ``pdserve up`` passes on to the router (vLLM's names), read back by the router's own
parser: what the launcher writes is what the router runs with."""

from __future__ import annotations

import argparse

import pytest

from router.config import RouterConfig
from shared.cli import launcher
from shared.cli.launcher import cluster_args
from shared.cpu_bind import BIND_ENV

pytestmark = pytest.mark.unit


def router_config_of(monkeypatch, tmp_path, flags: list[str]) -> RouterConfig:
    """What the router that ``pdserve up <flags>`` starts runs with: its argv, read back by
    the router's own parser (nothing spawned; the launcher stopped afterwards)."""
    monkeypatch.setenv(BIND_ENV, "nobind")
    cluster = launcher.Cluster(
        cluster_args(
            ["--model", "m", "--port", "0", "--host", "127.0.0.1", "--run-dir", str(tmp_path)]
            + flags
        )
    )
    spawned: dict = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, argv, **kw: spawned.setdefault(name, argv))
    monkeypatch.setattr(cluster, "_wait_http", lambda child, url: None)
    try:
        cluster.start_router()
    finally:
        cluster.stop()
    p = argparse.ArgumentParser()
    RouterConfig.add_cli_args(p)
    return RouterConfig.from_cli_args(p.parse_args(spawned["router"][1:]))


@pytest.mark.parametrize("trust", [False, True])
def test_pdserve_up_passes_trust_request_chat_template_to_the_router(monkeypatch, tmp_path, trust):
    flag = ["--trust-request-chat-template"] if trust else []
    assert router_config_of(monkeypatch, tmp_path, flag).trust_request_chat_template is trust


@pytest.mark.parametrize("value", [None, 0, 512])
def test_the_idle_local_prefill_bound_reaches_the_routing_policy(value):
    p = argparse.ArgumentParser()
    RouterConfig.add_cli_args(p)
    argv = ["--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]
    argv += [] if value is None else [f"--idle-local-prefill-tokens={value}"]
    policy = RouterConfig.from_cli_args(p.parse_args(argv)).policy
    assert policy.idle_local_prefill_tokens == (1024 if value is None else value)


def test_pdserve_up_passes_tokenizer_to_the_router(monkeypatch, tmp_path):
    """The router does all tokenizing, detokenizing and chat templating: a ``--tokenizer``
    that reached only the workers (as it did) left the router on the model directory's
    vocabulary while the workers compiled grammars with another."""
    cfg = router_config_of(monkeypatch, tmp_path, ["--tokenizer", "/models/tok"])
    assert cfg.tokenizer == "/models/tok"

"""``env_int`` / ``env_float``: the numbers the engine reads from its environment. Unset or
empty is the default; anything else that is not a number at or above the minimum is a
``ConfigError`` naming the variable (a worker turns it into one line and exit status 2)."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, env_float, env_int


def test_env_int_reads_the_value_or_the_default(monkeypatch):
    monkeypatch.delenv("PDSERVE_TEST_N", raising=False)
    assert env_int("PDSERVE_TEST_N", 7) == 7
    monkeypatch.setenv("PDSERVE_TEST_N", "  ")
    assert env_int("PDSERVE_TEST_N", 7) == 7
    monkeypatch.setenv("PDSERVE_TEST_N", " 0 ")
    assert env_int("PDSERVE_TEST_N", 7) == 0
    monkeypatch.setenv("PDSERVE_TEST_N", "49152")
    assert env_int("PDSERVE_TEST_N", 7) == 49152


@pytest.mark.parametrize("raw,minimum", [("1.5", 0), ("abc", 0), ("-1", 0), ("0", 1)])
def test_env_int_rejects_with_the_variable_named(monkeypatch, raw, minimum):
    monkeypatch.setenv("PDSERVE_TEST_N", raw)
    with pytest.raises(ConfigError, match=rf"PDSERVE_TEST_N='{raw}': expected an integer >= "):
        env_int("PDSERVE_TEST_N", 7, minimum=minimum)


def test_env_float_reads_the_value_or_the_default(monkeypatch):
    monkeypatch.delenv("PDSERVE_TEST_X", raising=False)
    assert env_float("PDSERVE_TEST_X", 60.0) == 60.0
    monkeypatch.setenv("PDSERVE_TEST_X", "0.25")
    assert env_float("PDSERVE_TEST_X", 60.0) == 0.25


@pytest.mark.parametrize("raw", ["soon", "nan", "inf", "-2", "0"])
def test_env_float_rejects_with_the_variable_named(monkeypatch, raw):
    monkeypatch.setenv("PDSERVE_TEST_X", raw)
    with pytest.raises(ConfigError, match=rf"PDSERVE_TEST_X='{raw}': expected a number >= 0.001"):
        env_float("PDSERVE_TEST_X", 60.0, minimum=0.001)

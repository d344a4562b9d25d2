"""HTTPS at the router's edge: ``pdserve router`` as a real process with ``--ssl-*`` flags
and a certificate made for the test (``trustme``), called with the ``openai`` SDK trusting
only that CA; mutual TLS with ``--ssl-cert-reqs 2``; and the start-up checks of the TLS flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from router_harness import MODEL_NAME, ROOT, free_port

from router.config import RouterConfig, check_tls_files

PDSERVE = [sys.executable, "-m", "shared.cli"]
FILE_KEY, ENV_KEY = "tls-file-key-0123456789", "tls-env-key-9876543210"


class Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""

    def __init__(self, root: Path) -> None:
        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        client = self.ca.issue_cert("client@pdserve.test")
        self.ca_pem = root / "ca.pem"
        self.cert_pem, self.key_pem = root / "server.pem", root / "server.key"
        self.client_pem = root / "client.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        server.private_key_pem.write_to_path(str(self.key_pem))
        with open(self.cert_pem, "wb") as f:  # leaf first, then the chain
            for blob in server.cert_chain_pems:
                f.write(blob.bytes())
        client.private_key_and_cert_chain_pem.write_to_path(str(self.client_pem))

    def client_context(self, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_pem))  # this CA only
        if with_cert:
            ctx.load_cert_chain(str(self.client_pem))
        return ctx


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return Certs(tmp_path_factory.mktemp("certs"))


def start_router(tiny_model, redis_server, prefix, tmp_path, certs, *extra, inherit=False):
    """``pdserve router`` over HTTPS (the file key and the env key), once it is healthy;
    ``inherit``: on a listening socket it inherits (``--fd``, as ``pdserve up`` starts it)."""
    port = free_port()
    held = None
    if inherit:
        held = socket.socket()
        held.bind(("127.0.0.1", port))
        held.listen(16)
        extra = (*extra, "--fd", str(held.fileno()))
    keys = tmp_path / "keys"
    keys.write_text(f"# router keys\n{FILE_KEY}\n")
    keys.chmod(0o600)
    log = tmp_path / f"router-{port}.log"
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    env["VLLM_API_KEY"] = ENV_KEY
    with open(log, "w") as out:
        proc = subprocess.Popen(
            PDSERVE
            + ["router", "--model", str(tiny_model), "--served-model-name", MODEL_NAME]
            + ["--redis-url", redis_server.url, "--directory-prefix", prefix]
            + ["--host", "127.0.0.1", "--port", str(port), "--worker-refresh-interval", "0.1"]
            + ["--api-key-file", str(keys), "--disable-uvicorn-access-log"]
            + ["--ssl-keyfile", str(certs.key_pem), "--ssl-certfile", str(certs.cert_pem)]
            + list(extra),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(held.fileno(),) if held else (),
        )
    if held is not None:
        held.close()  # the router's copy serves it
    url = f"https://127.0.0.1:{port}"
    ctx = certs.client_context(with_cert=True)
    deadline = time.monotonic() + 30
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", verify=ctx, timeout=1).status_code == 200:
                    return proc, url, log
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router never became healthy: " + log.read_text()
            time.sleep(0.1)
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.mark.integration
def test_openai_sdk_over_https(tiny_model, make_worker, redis_server, prefix, tmp_path, certs):
    make_worker("tls-d0")
    proc, url, log = start_router(tiny_model, redis_server, prefix, tmp_path, certs)
    try:
        for key in (FILE_KEY, ENV_KEY):
            with httpx.Client(verify=certs.client_context(), timeout=20) as http:
                client = openai.OpenAI(
                    base_url=f"{url}/v1", api_key=key, http_client=http, max_retries=0
                )
                assert [m.id for m in client.models.list()] == [MODEL_NAME]
                out = client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                    extra_body={"ignore_eos": True},
                )
                assert out.usage.completion_tokens == 3
                assert out.choices[0].finish_reason == "length"
        with httpx.Client(verify=certs.client_context(), timeout=20) as http:
            wrong = openai.OpenAI(
                base_url=f"{url}/v1", api_key=FILE_KEY[:-1] + "X", http_client=http, max_retries=0
            )
            with pytest.raises(openai.AuthenticationError) as e:
                wrong.models.list()
            assert e.value.status_code == 401
            assert e.value.body == {
                "message": "invalid API key",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
            resp = http.get(f"{url}/metrics")  # no key, over TLS too
            assert resp.status_code == 401
            assert resp.headers["www-authenticate"] == 'Bearer realm="pdserve"'
        # the certificate is checked: a client that does not trust the CA is refused
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", verify=ssl.create_default_context(), timeout=5)
        # plain HTTP on the HTTPS port gets no answer from the app
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
        text = log.read_text()
        assert "2 API key(s) configured" in text and "serving HTTPS" in text
        assert FILE_KEY not in text and ENV_KEY not in text  # no line echoes a key
    finally:
        stop(proc)


@pytest.mark.integration
def test_mutual_tls_requires_a_client_certificate(
    tiny_model, make_worker, redis_server, prefix, tmp_path, certs
):
    make_worker("mtls-d0")
    proc, url, log = start_router(
        tiny_model,
        redis_server,
        prefix,
        tmp_path,
        certs,
        "--ssl-ca-certs",
        str(certs.ca_pem),
        "--ssl-cert-reqs",
        "2",
        inherit=True,
    )
    try:
        headers = {"Authorization": f"Bearer {FILE_KEY}"}
        ok = httpx.get(
            f"{url}/v1/models",
            headers=headers,
            verify=certs.client_context(with_cert=True),
            timeout=10,
        )
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL_NAME
        # without a client certificate the handshake fails (TLS 1.3 reports it on first read)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/v1/models", headers=headers, verify=certs.client_context(), timeout=5)
        # a certificate and no key: TLS lets it in, the API key check does not
        resp = httpx.get(f"{url}/v1/models", verify=certs.client_context(True), timeout=10)
        assert resp.status_code == 401
        # all of it on the socket it inherited (pdserve up's way), and said so
        assert f"serving on {url} (inherited socket" in log.read_text()
    finally:
        stop(proc)


# ---- start-up checks of the TLS flags -----------------------------------------------------


def config(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--decode-workers", "h:1", *argv])
    return RouterConfig.from_cli_args(ns)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--ssl-keyfile", "k.pem"), "--ssl-keyfile and --ssl-certfile must be given together"),
        (("--ssl-certfile", "c.pem"), "--ssl-keyfile and --ssl-certfile must be given together"),
        (("--ssl-ca-certs", "ca.pem"), "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile"),
        (
            ("--ssl-keyfile", "k", "--ssl-certfile", "c", "--ssl-cert-reqs", "2"),
            "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs",
        ),
    ],
)
def test_tls_flags_that_do_not_go_together(argv, message):
    with pytest.raises(ValueError) as e:
        config(*argv)
    assert str(e.value).startswith(message)


@pytest.mark.unit
def test_ssl_cert_reqs_takes_0_1_2_only(capsys):
    assert config("--ssl-keyfile", "k", "--ssl-certfile", "c").ssl_cert_reqs == ssl.CERT_NONE
    with pytest.raises(SystemExit) as e:
        config("--ssl-cert-reqs", "3")
    assert e.value.code == 2
    assert "invalid choice: 3 (choose from 0, 1, 2)" in capsys.readouterr().err


@pytest.mark.unit
def test_tls_files_are_loaded_at_start_up(certs, tmp_path):
    good = ("--ssl-keyfile", str(certs.key_pem), "--ssl-certfile", str(certs.cert_pem))
    check_tls_files(config(*good))  # no error
    check_tls_files(config(*good, "--ssl-ca-certs", str(certs.ca_pem), "--ssl-cert-reqs", "2"))
    check_tls_files(config())  # no TLS, nothing to check

    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=f"^--ssl-keyfile {missing}: not a readable file$"):
        check_tls_files(
            config("--ssl-keyfile", str(missing), "--ssl-certfile", str(certs.cert_pem))
        )
    with pytest.raises(ValueError, match=f"^--ssl-certfile {tmp_path}: not a readable file$"):
        check_tls_files(
            config("--ssl-keyfile", str(certs.key_pem), "--ssl-certfile", str(tmp_path))
        )
    other = certs.ca.issue_cert("127.0.0.1")  # a key that does not match the certificate
    other_key = tmp_path / "other.key"
    other.private_key_pem.write_to_path(str(other_key))
    with pytest.raises(ValueError, match="cannot load the certificate and its key"):
        check_tls_files(
            config("--ssl-keyfile", str(other_key), "--ssl-certfile", str(certs.cert_pem))
        )
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"^--ssl-ca-certs {junk}: cannot load it"):
        check_tls_files(config(*good, "--ssl-ca-certs", str(junk)))


def test_a_bad_tls_flag_exits_2_before_binding(tmp_path):
    out = subprocess.run(
        PDSERVE
        + ["router", "--model", str(tmp_path / "none"), "--redis-url", "redis://127.0.0.1:1"]
        + ["--ssl-keyfile", str(tmp_path / "k.pem"), "--ssl-certfile", str(tmp_path / "c.pem")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"pdserve router: error: --ssl-certfile {tmp_path / 'c.pem'}: not a readable file"
    )

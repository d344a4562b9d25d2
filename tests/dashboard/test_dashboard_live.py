"""The dashboard against a real cluster (Redis, 1 prefill + 1 decode engine on the tiny model,
the router process): its JSON, and the page in a real headless Chromium while load runs.

The browser test writes a screenshot taken under load to its tmp dir; with
``PDSERVE_UPDATE_SCREENSHOT=1`` it also replaces ``docs/img/dashboard.png`` (the README's).
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster_utils import make_cluster, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOT = ROOT / "docs" / "img" / "dashboard.png"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(
        tiny_llama,
        tmp_path_factory.mktemp("dash"),
        "--router-arg=--local-prefill-threshold=0",
        "--router-arg=--idle-local-prefill-tokens=0",
        "--served-model-name=tiny-llama",
        prefill=1,
        decode=1,
    )
    try:
        url = c.start()
        yield c, url
    finally:
        c.stop()


class Load:
    """Threads sending 200-token completions (a shared 128-token prefix, so the prefix caches
    get hits) until stopped; counts successes and keeps the first failure."""

    def __init__(self, url: str, model: str, threads: int = 2, max_tokens: int = 24) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        shared = [random.Random(99).randrange(5, 2000) for _ in range(128)]
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                prompt = shared + [rng.randrange(5, 2000) for _ in range(72)]
                try:
                    r = client.post(
                        "/v1/completions",
                        json={
                            "model": self.model,
                            "prompt": prompt,
                            "max_tokens": self.max_tokens,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    r.raise_for_status()
                    self.done += 1
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    self.error = self.error or e
                    return

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def test_data_endpoint_reflects_real_requests(cluster):
    c, url = cluster
    with httpx.Client(base_url=url, timeout=60) as client:
        before = client.get("/dashboard/data").json()

        def disaggregated():  # the cost model may also pick local prefill for some requests
            if load.error or load.done < 4:
                return load.error
            d = client.get("/dashboard/data").json()
            return d if any(r["path"] == "disagg" for r in d["recent"]) else None

        with Load(url, c.served_model_name, threads=1) as load:
            wait_until(disaggregated, timeout=40, what="4 requests, one of them disaggregated")
        assert load.error is None, load.error
        time.sleep(1.1)  # past the scrape cache
        d = client.get("/dashboard/data").json()
    ids = {w["id"]: w for w in d["workers"]}
    assert set(ids) == {"prefill-0", "decode-0"}
    assert all(w["scrape"]["ok"] for w in d["workers"]), d["workers"]
    assert ids["prefill-0"]["role"] == "prefill" and ids["decode-0"]["num_blocks"] > 0
    assert d["window"]["requests_total"] - before["window"]["requests_total"] >= 4
    assert d["window"]["requests_per_s"] > 0 and d["window"]["ttft"]["p50"] > 0
    assert sum(d["router"]["paths"].values()) - sum(before["router"]["paths"].values()) >= 4
    assert d["router"]["paths"]["disagg"] >= 1
    r = next(r for r in d["recent"] if r["path"] == "disagg")
    assert r["decode_worker"] == "decode-0" and r["prefill_worker"] == "prefill-0"
    assert r["prompt_tokens"] == 200 and r["completion_tokens"] == 24
    t = r["timings"]
    assert t["prefill_s"] > 0 and t["transfer_s"] > 0 and t["transfer_bytes"] > 0
    assert sum(p["s"] for p in r["phases"]) == pytest.approx(r["e2e_s"], rel=1e-6)
    # the shared prefix was served from the caches, and KV moved from P to D
    assert ids["decode-0"]["scrape"]["prefix_hits"] > 0
    assert ids["prefill-0"]["scrape"]["transfer_bytes"] > 0
    assert ids["decode-0"]["scrape"]["transfer_bytes"] > 0


def _driver(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1440,1640",
        "--hide-scrollbars",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


def _number(text: str) -> float:
    text = text.strip()
    scale = {"k": 1e3, "M": 1e6}.get(text[-1:], 1.0)
    return float(text.rstrip("kM")) * scale


_SNAPSHOT_JS = """
const rows = [...document.querySelectorAll(arguments[0])];
return rows.map((r) => ({
  text: r.innerText,
  attrs: Object.fromEntries([...r.attributes].map((a) => [a.name, a.value])),
  cells: [...r.cells].map((c) => c.innerText),
  bars: [...r.querySelectorAll(".bar > div")].map((b) => b.getBoundingClientRect().width),
}));
"""


def _rows(driver, selector: str) -> list[dict]:
    """The rows matching ``selector`` as plain data, read in one script call. The page
    re-renders its tables on every poll, so an element handle found in one poll is stale in
    the next (this test once failed with StaleElementReferenceException reading ``row.text``
    after such a re-render); a snapshot taken in one call cannot go stale."""
    return driver.execute_script(_SNAPSHOT_JS, selector)


def _text(driver, element_id: str) -> str:
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : '';", element_id
    )


@pytest.mark.browser
@pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
    reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)",
)
def test_dashboard_page_shows_workers_and_live_load(cluster, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    c, url = cluster
    driver = _driver(tmp_path / "profile")
    try:
        wait = WebDriverWait(driver, 20, poll_frequency=0.2)
        driver.get(f"{url}/dashboard")
        wait.until(lambda d: _text(d, "status") == "live")
        for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            row = wait.until(lambda d, w=wid: _rows(d, f'#workers tr[data-worker-id="{w}"]'))[0]
            assert role in row["text"] and "routable" in row["text"], row["text"]
        start = _number(_text(driver, "kpi-requests-total"))

        with Load(url, c.served_model_name, threads=2) as load:
            # the count and the rate go up while load runs
            wait.until(lambda d: _number(_text(d, "kpi-requests-total")) >= start + 5)
            wait.until(lambda d: _number(_text(d, "kpi-req-rate")) > 0)
            wait.until(lambda d: _text(d, "kpi-ttft") not in ("", "–", "– / –"))
            # a phase-breakdown row of a disaggregated request, with prefill and KV transfer
            row = wait.until(
                lambda d: [
                    r
                    for r in _rows(d, '#recent tr[data-path="disagg"]')
                    if float(r["attrs"].get("data-prefill-s") or 0) > 0
                    and float(r["attrs"].get("data-transfer-s") or 0) > 0
                ]
            )[0]
            assert "prefill-0 → decode-0" in row["text"]
            assert "prefill" in row["text"] and "KV" in row["text"] and "blocks" in row["text"]
            assert len(row["bars"]) >= 3 and all(w >= 0 for w in row["bars"])
            # worker figures scraped from the workers' /metrics: KV moved from P to D
            wait.until(
                lambda d: any(
                    "/s" in r["cells"][11]
                    for r in _rows(d, '#workers tr[data-worker-id="decode-0"]')
                    if len(r["cells"]) > 11
                )
            )
            # let the charts gather a few seconds of history, then take the screenshot
            time.sleep(12)
            assert load.error is None, load.error
            shot = tmp_path / "dashboard.png"
            driver.save_screenshot(str(shot))
            mid = _number(_text(driver, "kpi-requests-total"))
        assert mid > start and load.done > 0
        assert shot.stat().st_size > 20_000
        if os.environ.get("PDSERVE_UPDATE_SCREENSHOT") == "1":
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT)
        # no script error, no blocked request (the CSP would report any external load)
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()

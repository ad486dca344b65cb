"""The web page at ``/``: self-contained, and (marked ``browser``) driven in headless Chromium.

The browser test types a question, sees streamed text appear in the chat, sees the metrics panel
update, and keeps a screenshot (``$BYTEDIET_ARTIFACTS`` or pytest's tmp dir) as its artifact.
Run it with ``pytest -m browser tests/server/test_web.py`` (Debian: ``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from bytediet.server.config import ServerConfig
from tests.server.conftest import client, live, run

KEY = "sk-page"


def test_page_is_self_contained_and_open_without_a_key(make_server):
    s = make_server(ServerConfig(api_keys=(KEY,)))

    async def go():
        async with client(s.app) as c:
            return await c.get("/")

    r = run(go())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page must load nothing external"
    assert "@import" not in html and "/v1/chat/completions" in html and "/metrics" in html
    for metric in (
        "generation_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "engine_info",
        "kv_cache_compression_ratio",
    ):
        assert metric in html


def test_metrics_carry_what_the_panel_shows(server):
    async def go():
        async with client(server.app) as c:
            return (await c.get("/metrics")).text

    text = run(go())
    assert re.search(r'bytediet:engine_info\{.*kv_codec="[^"]+".*weight_format="[^"]+".*\} 1\.0', text), text
    ratio = float(re.search(r"bytediet:kv_cache_compression_ratio\{[^}]*\} (\S+)", text).group(1))
    assert ratio == pytest.approx(0.5)  # the tiny model's fp32 cache: twice the bytes of fp16


@pytest.mark.browser
def test_chat_streams_and_the_panel_updates_in_headless_chromium(make_server, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    s = make_server(ServerConfig(api_keys=(KEY,)))
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,800"):
        options.add_argument(arg)
    artifacts = Path(os.environ.get("BYTEDIET_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with live(s.app) as (host, port):
        browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
        try:
            wait = WebDriverWait(browser, 60)
            browser.get(f"http://{host}:{port}/")
            wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("metrics: scrape"))
            assert b_text(browser, "m-codec") not in ("", "–") and "vs fp16" in b_text(browser, "m-ratio")
            browser.find_element(By.ID, "key").send_keys(KEY)
            browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
            wait.until(lambda b: b_text(b, "model").startswith("tiny"))  # /v1/models answers with the key
            browser.find_element(By.ID, "prompt").send_keys("Who is Mr Darcy?")
            browser.find_element(By.ID, "send").click()
            # streamed text appears before the reply is complete, then the reply completes without error
            wait.until(
                lambda b: (
                    b.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")
                    and b.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text
                )
            )
            wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"))
            assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error"), b_text(browser, "log")
            # the panel picks up the generated tokens on its next scrapes
            wait.until(lambda b: b_text(b, "m-gen") not in ("", "–", "0"))
            assert float(b_text(browser, "m-tps")) >= 0
            browser.save_screenshot(str(artifacts / "web_page.png"))
        finally:
            browser.quit()
    assert (artifacts / "web_page.png").stat().st_size > 10_000


def b_text(browser, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.ID, element_id).text

"""`memfit serve`'s /docs page in headless Chromium (Debian's chromium + chromium-driver, driven by selenium):
it renders every route of /openapi.json from the server's own assets, with no network, and its "Try it out"
runs a real request. Skipped, saying why, where no browser is installed (scripts/install-browser.sh)."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from memfit.serve import ServeOptions, create_app
from http_server import ThreadServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install 'memfit[test]')")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="no headless Chromium (chromium and chromedriver); run scripts/install-browser.sh",
    ),
]
TIMEOUT = 60.0


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--window-size=1280,2000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(predicate, what: str):
    """``predicate()`` once it is truthy, polled for at most TIMEOUT seconds."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_docs_lists_every_route_and_try_it_out_runs_a_request(browser, tiny_model_dir):
    from selenium.webdriver.common.by import By

    with ThreadServer(create_app(ServeOptions(model=tiny_model_dir, dtype="fp32"))) as server:
        spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
        wanted = {(method.upper(), path) for path, methods in spec["paths"].items() for method in methods}
        browser.get(server.url + "/docs")

        def listed():
            blocks = browser.find_elements(By.CSS_SELECTOR, ".opblock")
            return {
                (
                    b.find_element(By.CSS_SELECTOR, ".opblock-summary-method").text,
                    b.find_element(By.CSS_SELECTOR, ".opblock-summary-path").get_attribute("data-path"),
                )
                for b in blocks
            }

        shown = wait_for(lambda: listed() if len(listed()) >= len(wanted) else None, "every route on /docs")
        assert shown == wanted

        # "Try it out" on POST /tokenize: open it, edit the example body, execute, read the live response
        block = browser.find_element(By.CSS_SELECTOR, "#operations-text-embeddings-inference-tokenize_tokenize_post")
        block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
        wait_for(lambda: block.find_elements(By.CSS_SELECTOR, ".try-out__btn"), "the Try it out button")[0].click()
        editor = wait_for(lambda: block.find_elements(By.CSS_SELECTOR, "textarea.body-param__text"), "the body editor")[
            0
        ]
        editor.clear()
        editor.send_keys(json.dumps({"inputs": "hello world", "add_special_tokens": False}))
        block.find_element(By.CSS_SELECTOR, ".execute").click()
        live = ".live-responses-table tr.response"
        status = wait_for(
            lambda: block.find_elements(By.CSS_SELECTOR, f"{live} .response-col_status"), "the live response"
        )[0]
        assert status.text.strip().startswith("200")
        shown_body = block.find_element(By.CSS_SELECTOR, f"{live} .response-col_description pre").text
        want = httpx.post(
            server.url + "/tokenize", json={"inputs": "hello world", "add_special_tokens": False}, timeout=30
        ).json()
        assert json.loads(shown_body) == want
        assert [t["text"] for t in want[0]] == ["hello", "world"]

        # everything the page loaded came from the server itself: no CDN
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert loaded and all(name.startswith(server.url) for name in loaded), loaded
        assert any(name.endswith("/docs/assets/swagger-ui-bundle.js") for name in loaded)

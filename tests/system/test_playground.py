"""The playground at `GET /`: the page itself (one file, nothing external), and in a real browser
(headless Chromium driven by Selenium) against a real `mm-engine serve` on the demo model: upload
`examples/scene.png`, ask, and read the streamed answer off the page, which must be the offline
engine's answer to the same chat. The browser test skips where no Chromium is installed
(`.ci/run` installs Debian's chromium and chromium-driver)."""

from __future__ import annotations

import base64
import re
import shutil
import tempfile

import httpx
import pytest

from helpers.api import ENGINE_KW, ROOT, run_server
from mm_engine import LLM, SamplingParams
from mm_engine.config import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

SCENE = ROOT / "examples" / "scene.png"
QUESTION = "Describe the image."
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server():
    with run_server(str(default_model_path())) as s:
        yield s


def test_the_page_is_one_file_with_nothing_external(server):
    r = httpx.get(server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # no script, style, font from elsewhere
    assert "/v1/chat/completions" in r.text and "response_format" in r.text


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="no chromium/chromedriver installed")
def test_chat_with_an_uploaded_image_in_headless_chromium(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url = "data:image/png;base64," + base64.b64encode(SCENE.read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip
    greedy = SamplingParams(max_tokens=24, temperature=0)
    want = LLM(None, **ENGINE_KW).chat(messages, greedy)[0].outputs[0].text

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="mm-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(server.base_url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        driver.find_element(By.ID, "file").send_keys(str(SCENE))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#thumbs img"))
        tokens = driver.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("24")
        driver.find_element(By.ID, "prompt").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        done = ".msg.assistant[data-done='true'], .msg.error"
        answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, done))
        assert "error" not in answer.get_attribute("class"), answer.text
        assert answer.find_element(By.CSS_SELECTOR, ".text").text.strip() == want.strip()  # " a red ..."
        stats = driver.find_element(By.ID, "stats").text
        assert re.search(r"TTFT \d+\.\d\d s · \d+ tokens · [\d.]+ tokens/s", stats), stats
        assert driver.find_elements(By.CSS_SELECTOR, ".msg.user img")  # the image went with the question
    finally:
        driver.quit()

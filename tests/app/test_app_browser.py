"""The page in a real browser: headless Chromium (Debian's, driven through its chromedriver) loads `vram-plan app`,
changes the model and the completion length, and sees the verdict and the bars follow what the API says; every
request stays on the machine (nothing from a CDN). The last screenshot is kept at tests/artifacts/app.png."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from helpers import LLAMA_1B
from serving import ROOT, api_document, free_port, running_server
from vram_planner.model.phases import PHASE_TITLES
from vram_planner.units import GiB

pytestmark = pytest.mark.slow  # a browser and a server: about half a minute

ARTIFACT = ROOT / "tests" / "artifacts" / "app.png"
WAIT_SECONDS = 60
GPU = "rtx3080-mobile-16gb"
# One bar segment as Vega-Lite describes it to screen readers: "phase: generation; GiB: 6.906; part: weights".
SEGMENT = re.compile(r"^phase: (?P<phase>.+); GiB: (?P<gib>[-\d.e]+); part: (?P<part>.+)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = str(free_port())
    log = tmp_path_factory.mktemp("app-browser") / "server.log"
    with running_server([sys.executable, "-m", "vram_planner", "app", "--host", "127.0.0.1", "--port", port],
                        log) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    found = {name: shutil.which(name) for name in ("chromium", "chromedriver")}
    missing = [name for name, path in found.items() if path is None]
    if missing:  # never a skip: CI must run this test
        pytest.fail(f"{' and '.join(missing)} not found: apt-get install chromium chromium-driver (.ci/run does)")
    options = Options()
    options.binary_location = found["chromium"]
    # The only host the page may reach is this machine: a fetch from a CDN fails and shows in the resources below.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1900", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(found["chromedriver"]))
    driver.set_page_load_timeout(WAIT_SECONDS)
    yield driver
    driver.quit()


def expected_bars(document: dict) -> dict[tuple[str, str], float]:
    """The segments the page should draw for a check document: each part of each phase, and the card's free rest."""
    bars = {}
    for phase in document["phases"]:
        title = PHASE_TITLES[phase["name"]]
        bars |= {(title, part.replace("_", " ")): n_bytes / GiB for part, n_bytes in phase["components"].items()
                 if n_bytes}
        if document["capacity_bytes"] > phase["total_bytes"]:
            bars[(title, "free")] = (document["capacity_bytes"] - phase["total_bytes"]) / GiB
    return bars


def drawn_bars(driver, plot_id: str = "bars") -> dict[tuple[str, str], float]:
    # read in one go: the plot redraws its SVG while the page updates
    labels = driver.execute_script("return Array.from(document.querySelectorAll(arguments[0]), "
                                   "e => e.getAttribute('aria-label'))", f"#{plot_id} svg [aria-label]")
    matches = [SEGMENT.match(label or "") for label in labels]
    return {(m["phase"], m["part"]): float(m["gib"]) for m in matches if m and float(m["gib"])}  # drawn: not 0


def drawn_capacity(driver, plot_id: str) -> float:
    label = driver.find_element(By.CSS_SELECTOR, f"#{plot_id} svg line.capacity").get_attribute("aria-label")
    return float(re.fullmatch(r"capacity: ([\d.]+) GiB", label)[1])


def same_bars(drawn: dict, expected: dict) -> bool:
    return drawn.keys() == expected.keys() and all(abs(drawn[k] - expected[k]) < 0.001 for k in expected)


def shows(driver, server: str, query: dict) -> tuple[dict, str]:
    """Wait until the page's bars are those of the API's check document for `query`; the document and the verdict."""
    status, document = api_document(server, "check", query)
    assert status == 200, document
    expected = expected_bars(document)
    try:
        WebDriverWait(driver, WAIT_SECONDS).until(lambda d: same_bars(drawn_bars(d), expected))
    except TimeoutException:
        driver.save_screenshot(str(ARTIFACT))
        raise AssertionError(f"the bars for {query} never appeared: drawn {drawn_bars(driver)}, expected {expected};"
                             f" verdict {driver.find_element(By.ID, 'verdict').text!r}; screenshot at {ARTIFACT}")
    return document, driver.find_element(By.ID, "verdict").text


def verdict_agrees(verdict: str, document: dict) -> None:
    assert verdict.startswith("✔ Fits" if document["fits"] else "✘ Does not fit as given"), verdict
    assert f"peak {document['peak_bytes'] / GiB:.2f} of {document['capacity_bytes'] / GiB:.2f} GiB" in verdict


def type_into(driver, field_id: str, text: str, enter: bool = False) -> None:
    selector = f"#{field_id} input, #{field_id} textarea"
    field = WebDriverWait(driver, WAIT_SECONDS).until(  # an accordion renders its fields when it opens
        lambda d: next((e for e in d.find_elements(By.CSS_SELECTOR, selector) if e.is_displayed()), None))
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(text)
    if enter:
        field.send_keys(Keys.ENTER)


def test_the_page_follows_the_model_and_the_completion_length(browser, server, tmp_path):
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    browser.get(server + "/")

    document, verdict = shows(browser, server, {"gpu": GPU, "model": "Llama-3.2-1B"})
    verdict_agrees(verdict, document)
    for chart in ("bars", "plan_bars"):  # the card's capacity on every chart, the plan's too
        assert drawn_capacity(browser, chart) == pytest.approx(document["capacity_bytes"] / GiB, abs=0.005)
    font = browser.execute_script("return getComputedStyle(document.querySelector('#verdict')).fontFamily")
    assert font.startswith("system-ui"), font  # the system's fonts, not a bundled web font
    assert not document["fits"] and "With the plan's 1 change below it fits" in verdict
    assert "adamw_8bit" in browser.find_element(By.ID, "changes").text
    assert "optim='adamw_8bit'" in browser.find_element(By.ID, "code").text
    assert "Longest completion that fits" in browser.find_element(By.ID, "longest").text

    type_into(browser, "model", "Qwen3-0.6B", enter=True)
    document, verdict = shows(browser, server, {"gpu": GPU, "model": "Qwen3-0.6B"})
    verdict_agrees(verdict, document)
    assert document["fits"]
    assert browser.find_element(By.ID, "title").text.startswith("Qwen3-0.6B on the")

    type_into(browser, "max_completion_length", "4096")
    document, verdict = shows(browser, server, {"gpu": GPU, "model": "Qwen3-0.6B", "max_completion_length": 4096})
    verdict_agrees(verdict, document)
    assert not document["fits"]
    assert "max_completion_length=4096" in browser.find_element(By.ID, "code").text

    browser.save_screenshot(str(ARTIFACT))
    assert ARTIFACT.stat().st_size > 10_000

    type_into(browser, "max_completion_length", "abc")  # bad input: one line naming the field, where the verdict goes
    expected = ("✘ error: max_completion_length should be a valid integer, unable to parse string as an integer "
                "(got 'abc')")
    # each keystroke re-judges the page: "ab" gives an error of its own before "abc" arrives, so wait for the last
    WebDriverWait(browser, WAIT_SECONDS).until(lambda d: d.find_element(By.ID, "verdict").text == expected)
    assert browser.find_element(By.ID, "verdict").text == expected

    type_into(browser, "max_completion_length", "1024")
    browser.find_element(By.XPATH, "//span[contains(text(), 'or paste a config.json')]").click()
    type_into(browser, "pasted_config", json.dumps(LLAMA_1B))
    pasted = tmp_path / "config.json"
    pasted.write_text(json.dumps(LLAMA_1B))
    document, verdict = shows(browser, server, {"gpu": GPU, "model": str(pasted), "max_completion_length": 1024})
    verdict_agrees(verdict, document)
    assert browser.find_element(By.ID, "title").text.startswith("pasted config.json on the")

    elsewhere = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"
                                       ".filter(name => !name.startsWith(arguments[0]))", server)
    assert elsewhere == [], f"the page fetched from other hosts: {elsewhere}"
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert severe == [], severe


def test_the_results_sit_beside_the_inputs_on_a_wide_screen_and_first_on_a_narrow_one(browser, server):
    for width, beside in ((1400, True), (800, False)):
        browser.set_window_size(width, 1600)
        browser.get(server + "/")
        shows(browser, server, {"gpu": GPU, "model": "Llama-3.2-1B"})
        results = browser.find_element(By.ID, "results").rect
        inputs = browser.find_element(By.ID, "inputs").rect
        if beside:
            assert results["x"] > inputs["x"] + inputs["width"] / 2 and abs(results["y"] - inputs["y"]) < 50
        else:
            assert results["y"] + results["height"] <= inputs["y"] + 1 and results["width"] > 0.9 * inputs["width"]
            narrow = ARTIFACT.with_name("app-narrow.png")
            browser.save_screenshot(str(narrow))
            assert narrow.stat().st_size > 10_000
            # the labels of the verdict are not cut: the text fits inside the page's width
            overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"the page is {overflow} px wider than the window"
    browser.set_window_size(1400, 1900)


def test_the_api_describes_itself_to_a_browser(browser, server):
    browser.get(server + "/api/openapi.json")
    description = json.loads(browser.find_element(By.TAG_NAME, "body").text)
    assert set(description["paths"]) >= {"/api/check", "/api/plan", "/api/gpus", "/api/models"}
    browser.get(server + "/")
    link = WebDriverWait(browser, WAIT_SECONDS).until(
        lambda d: next(iter(d.find_elements(By.CSS_SELECTOR, "#api_links a[href='/api/openapi.json']")), None))
    assert link.text == "/api/openapi.json"

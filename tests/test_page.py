"""The page of `lmhead serve` and the `score --html` export, in a real browser: Debian's chromium,
headless, driven by Selenium through Debian's chromium-driver (.ci/run installs both when missing;
without them these tests are skipped with the reason).

What the browser shows is checked against the CLI's own --json documents (`score --json`,
`inspect --json`): the DOM contract (every token [data-token-id]; scored ones data-rank and
data-logprob), the tooltips, the next-token panel, the errors, and that nothing is fetched from
anywhere but the file or 127.0.0.1, and that no markup, script or control character from a text, a
prompt or a model ever runs or reaches the page unescaped."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import pytest
from helpers import control_byte_checkpoint, nan_checkpoint, serving
from typer.testing import CliRunner

from lmhead_cli.cli import app
from lmhead_cli.render import safe_text, show_token

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver; .ci/run installs them)")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1200,900")
WAIT_S = 120
HOSTILE_TEXT = ('<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2">'
                "\x1b]0;HACKED\x07\x1b[2J[bold]hi[/] <b>bold</b> &amp; \u202eevil")
WORDS = ("the keys on table are here and there we go to a house of light , . ; : ! ? café naïve 日本語 "
         "über straße 1999 2026 ( ) \" ' - \n").split(" ")

runner = CliRunner()


def cli_json(args: list[str]) -> dict:
    got = runner.invoke(app, args)
    assert got.exit_code == 0, got.stderr
    return json.loads(got.stdout)


def make_text(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """A text of at least n_tokens tokens from a fixed word list (with accents, CJK, punctuation and line
    breaks, so byte-level tokens split characters and pieces hold newlines)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        have = len(tokenizer.encode_long(" ".join(words))) if words else 0
        if have >= n_tokens:
            return " ".join(words)
        words.extend(rng.choice(WORDS) for _ in range(max(8, (n_tokens - have) // 2)))


# ---- fixtures: the browser, the servers ------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager never looks for a driver online
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


class Server:
    """`lmhead serve --model SOURCE ARGS` in its own process on 127.0.0.1 (helpers.serving), and the same
    model loaded here (its tokenizer, its results)."""

    def __init__(self, source: str, *args: str):
        import lmhead_cli

        self.model = lmhead_cli.load(source, threads=1)
        self._running = serving(source, *args)
        self.url = self._running.__enter__().url

    def close(self) -> None:
        self._running.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(tiny):
    s = Server(str(tiny[0]))
    yield s
    s.close()


@pytest.fixture(scope="module")
def control_model(tmp_path_factory):
    return control_byte_checkpoint(tmp_path_factory.mktemp("control-bytes"))


# ---- reading the page --------------------------------------------------------------------------

def wait_for(driver, script: str, what: str, timeout: float = WAIT_S):
    """Poll a script until it returns something truthy; fail with `what` and the page's status lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = driver.execute_script(script)
        if got:
            return got
        time.sleep(0.05)
    statuses = driver.execute_script("return Array.from(document.querySelectorAll('.status'))"
                                     ".map(e => e.textContent)")
    pytest.fail(f"timed out waiting for {what}; status lines: {statuses}")


def state(driver, panel: str) -> str:
    """Wait for a panel (score, next, diff) of the served page to finish; return "done" or "error"."""
    return wait_for(driver, f"var s = document.getElementById('lmhead-page').getAttribute('data-{panel}-state');"
                            " return s === 'done' || s === 'error' ? s : null", f"the {panel} panel")


def start(driver, panel: str, button: str) -> str:
    driver.execute_script(f"document.getElementById('lmhead-page').setAttribute('data-{panel}-state', '')")
    driver.find_element("id", button).click()
    return state(driver, panel)


def dom_tokens(driver, scope: str = ".text") -> list[tuple]:
    return driver.execute_script(
        f"return Array.from(document.querySelectorAll('{scope} [data-token-id]')).map(e => "
        "[e.getAttribute('data-token-id'), e.getAttribute('data-rank'), e.getAttribute('data-logprob'), "
        "e.textContent])")


def check_contract(got: list[tuple], doc: dict, text: str) -> None:
    """The DOM's tokens against `score --json`: same ids in order, rank and logprob exactly on the scored
    ones and absent on the others, and the pieces joined give the text, terminal-safe."""
    assert len(got) == len(doc["tokens"])
    for (tid, rank, logprob, _), t in zip(got, doc["tokens"]):
        assert int(tid) == t["id"]
        if t["scored"]:
            assert int(rank) == t["rank"] and float(logprob) == t["logprob"], (t, rank, logprob)
        else:
            assert rank is None and logprob is None
    assert "".join(piece for *_, piece in got) == safe_text(text, keep="\n\t")


def controls(text: str) -> list[str]:
    return [repr(c) for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


def fetched_urls(driver) -> list[str]:
    """Every URL the page asked for: its resource timing entries and the DevTools network log."""
    urls = driver.execute_script("return [location.href].concat(performance.getEntriesByType('resource')"
                                 ".map(e => e.name))")
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def assert_local(urls: list[str], origin: str) -> None:
    """Every URL is the server's or inline. chrome:// ones are the browser's own (its built-in UI's icons,
    logged now and then under load), never the page's: they leave nothing."""
    outside = [u for u in urls if not (u.startswith(origin) or u.startswith(("data:", "chrome://")))]
    assert outside == [], outside


def not_pwned(driver) -> None:
    assert driver.execute_script("return window.__pwned === undefined")
    assert driver.execute_script("return document.querySelectorAll('img, iframe, b').length") == 0


# ---- the --html export ---------------------------------------------------------------------------

def export(model: str, text: str, path: Path) -> None:
    """`lmhead score TEXT --model MODEL --html PATH`."""
    got = runner.invoke(app, ["score", text, "--model", model, "--html", str(path)])
    assert got.exit_code == 0, got.stderr
    assert f"wrote {path}" in got.stderr


def test_html_export_contract_2000_tokens(browser, served, tiny, tmp_path):
    text = make_text(served.model.tokenizer, 2000)
    doc = cli_json(["score", text, "--model", str(tiny[0]), "--json"])
    assert len(doc["tokens"]) >= 2000
    page = tmp_path / "score.html"
    export(str(tiny[0]), text, page)
    browser.get_log("performance")  # drop what earlier pages fetched
    browser.get(page.as_uri())
    wait_for(browser, "return document.querySelector('[data-rendered]')", "the view")
    check_contract(dom_tokens(browser), doc, text)
    assert_local(fetched_urls(browser), "file://")
    legend = browser.execute_script("return document.querySelector('.legend').textContent")
    counts = [0] * 5
    for t in doc["tokens"]:
        if t["scored"]:
            counts[next(i for i, top in enumerate((1, 10, 100, 1000, math.inf)) if t["rank"] <= top)] += 1
    for name, n in zip(("top-1", "top-10", "top-100", "top-1000", "rest"), counts):
        assert f"{name} {n:,}" in legend
    summary = browser.execute_script("return document.querySelector('.summary').textContent")
    assert f"perplexity {doc['perplexity']:.4f}" in summary and f"{doc['bits_per_byte']:.4f} bits per byte" in summary


def test_notebook_fragments(browser, served, tmp_path):
    """Two score results in one notebook: each output carries its data and the script, which draws
    every view once (a second copy of the script only draws the views not yet drawn)."""
    texts = ("The keys on the table", "She opened the door and walked in.")
    cells = "".join(served.model.score(t, alternatives=5)._repr_html_() for t in texts)
    page = tmp_path / "notebook.html"
    page.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{cells}</body></html>",
                    encoding="utf-8")
    browser.get(page.as_uri())
    wait_for(browser, "return document.querySelectorAll('[data-rendered]').length === 2", "both views")
    counts = browser.execute_script("return Array.from(document.querySelectorAll('.text'))"
                                    ".map(t => t.querySelectorAll('[data-token-id]').length)")
    assert counts == [len(served.model.tokenizer.encode_long(t)) for t in texts]


def tip_text(driver) -> str:
    return wait_for(driver, "var t = document.querySelector('.tip'); return t && !t.hidden ? t.textContent : null",
                    "the tooltip")


def test_tooltip_on_hover_and_keyboard_and_the_strip(browser, served, tiny, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    text = "The keys on the table are on the table, and the keys are here."
    doc = cli_json(["score", text, "--model", str(tiny[0]), "--json"])
    page = tmp_path / "short.html"
    export(str(tiny[0]), text, page)
    browser.get(page.as_uri())
    wait_for(browser, "return document.querySelector('[data-rendered]')", "the view")
    spans = browser.find_elements("css selector", ".text [data-token-id]")
    ActionChains(browser).move_to_element(spans[3]).perform()
    t = doc["tokens"][3]
    tip = tip_text(browser)
    assert f"rank {t['rank']:,}" in tip and f"logprob {t['logprob']:.3f}" in tip
    assert f"surprisal {t['surprisal_bits']:.2f} bits" in tip and f"entropy {t['entropy']:.3f} nats" in tip
    assert f"varentropy {t['varentropy']:.3f} nats\u00b2 \u00b7 margin {t['margin']:.3f} nats" in tip
    rows = browser.execute_script("return Array.from(document.querySelectorAll('.tip tr'))"
                                  ".map(r => r.firstChild.textContent)")
    assert len(rows) == 5 and rows[0] == show_token(t["top_token"])  # the top-k, the model's top-1 first
    # keyboard: focus a token, the arrow moves to the next, its figures show
    spans[3].click()
    spans[3].send_keys(Keys.ARROW_RIGHT)
    assert browser.execute_script("return document.activeElement.getAttribute('data-i')") == "4"
    assert f"rank {doc['tokens'][4]['rank']:,}" in tip_text(browser)
    # the strip: its left edge goes to the first scored token, its right edge to the last
    strip = browser.find_element("css selector", ".strip")
    w = strip.size["width"]
    ActionChains(browser).move_to_element_with_offset(strip, -w // 2 + 1, 0).click().perform()
    assert browser.execute_script("return document.activeElement.getAttribute('data-i')") == "1"
    ActionChains(browser).move_to_element_with_offset(strip, w // 2 - 2, 0).click().perform()
    assert browser.execute_script("return document.activeElement.getAttribute('data-i')") == str(len(doc["tokens"]) - 1)


def test_the_text_can_be_coloured_by_entropy_as_well_as_by_rank(browser, tmp_path):
    """The button re-colours each scored token by the entropy bucket of its prediction (score --json's
    `entropy`), swaps the legend, and a second press brings the rank colours back."""
    text = "And God said, Let there be light: and there was light. And God saw the light, that it was good."
    doc = cli_json(["score", text, "--model", "bundled:tiny", "--json"])
    page = tmp_path / "entropy.html"
    export("bundled:tiny", text, page)
    browser.get(page.as_uri())
    wait_for(browser, "return document.querySelector('[data-rendered]')", "the view")
    classes = "return Array.from(document.querySelectorAll('.text [data-rank]')).map(e => e.className)"
    edges = [1.0, 2.0, 4.0, 6.0]
    by_entropy = [f"tok b{sum(t['entropy'] > e for e in edges)}" for t in doc["tokens"] if t["scored"]]
    by_rank = [f"tok b{sum(t['rank'] > e for e in (1, 10, 100, 1000))}" for t in doc["tokens"] if t["scored"]]
    assert len(set(by_entropy)) >= 3 and by_entropy != by_rank  # a text whose two colourings differ
    assert browser.execute_script(classes) == by_rank
    button = browser.find_element("css selector", ".colour-by")
    button.click()
    assert browser.execute_script(classes) == by_entropy and button.get_attribute("aria-pressed") == "true"
    assert browser.execute_script("return document.querySelector('.legend').getAttribute('aria-label')") == \
        "entropy buckets"
    button.click()
    assert browser.execute_script(classes) == by_rank and button.text == "colour by entropy"


def test_html_export_hostile(browser, control_model, tmp_path):
    page = tmp_path / "hostile.html"
    export(control_model, HOSTILE_TEXT, page)
    source = page.read_text(encoding="utf-8")
    assert "<script>window" not in source and "</script><img" not in source  # the data cannot close its element
    browser.get_log("performance")
    browser.get(page.as_uri())
    wait_for(browser, "return document.querySelector('[data-rendered]')", "the view")
    not_pwned(browser)
    shown = browser.execute_script("return document.querySelector('.text').textContent")
    assert shown == safe_text(HOSTILE_TEXT, keep="\n\t") and "\\x1b" in shown and "<script>" in shown
    browser.find_elements("css selector", ".text [data-rank]")[0].click()
    tip = tip_text(browser)
    assert "\\x1b" in tip and "\\x07" in tip  # the model's own top tokens, ESC and BEL, escaped
    assert controls(browser.execute_script("return document.body.textContent")) == []
    assert_local(fetched_urls(browser), "file://")


# ---- the served page -------------------------------------------------------------------------------

def test_served_page_shared_link(browser, served, tiny):
    from urllib.parse import quote

    text = make_text(served.model.tokenizer, 300, seed=1)
    doc = cli_json(["score", text, "--model", str(tiny[0]), "--json"])
    browser.get_log("performance")
    browser.get(f"{served.url}/?text={quote(text)}")
    assert state(browser, "score") == "done"
    check_contract(dom_tokens(browser, "#score-view .text"), doc, text)
    assert browser.execute_script("return document.getElementById('score-text').value") == text
    assert_local(fetched_urls(browser), served.url)


def test_next_token_panel(browser, served, tiny):
    prompt = "The keys on the table"
    doc = cli_json(["inspect", prompt, "--model", str(tiny[0]), "-k", "7", "-t", " are", "--json"])
    browser.get(served.url + "/")
    box = browser.find_element("id", "next-prompt")
    box.send_keys(prompt)
    k = browser.find_element("id", "next-k")
    k.clear()
    k.send_keys("7")
    browser.find_element("id", "next-targets").send_keys(" are")
    assert start(browser, "next", "next-go") == "done"
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#next-view tr[data-token-id]')).map(r => "
        "[r.className, +r.getAttribute('data-token-id'), +r.getAttribute('data-rank'), r.children[1].textContent])")
    top = [r for r in rows if "top" in r[0]]
    assert [(r[1], r[2], r[3]) for r in top] == [(t["id"], t["rank"], show_token(t["token"])) for t in doc["top"]]
    targets = [r for r in rows if "target" in r[0]]
    assert [(r[1], r[2]) for r in targets] == [(t["id"], t["rank"]) for t in doc["targets"]]
    # one click appends the top token to the prompt and reads the next one
    browser.execute_script("document.getElementById('lmhead-page').setAttribute('data-next-state', '')")
    browser.find_element("id", "next-append").click()
    assert state(browser, "next") == "done"
    assert box.get_attribute("value") == prompt + doc["top"][0]["token"]


def test_diff_view(browser, served, tiny):
    doc = cli_json(["diff", "The keys on the table", "The key on the table", "--model", str(tiny[0]), "--json"])
    browser.get(served.url + "/")
    browser.find_element("id", "diff-a").send_keys("The keys on the table")
    browser.find_element("id", "diff-b").send_keys("The key on the table")
    assert start(browser, "diff", "diff-go") == "done"
    ids = browser.execute_script("return Array.from(document.querySelectorAll('#diff-view .cols > div'))"
                                 ".map(d => Array.from(d.querySelectorAll('tr[data-token-id]')).map(r => "
                                 "+r.getAttribute('data-token-id')))")
    assert ids == [[t["id"] for t in doc["a"]["top"]], [t["id"] for t in doc["b"]["top"]]]


def test_calibration_of_the_pages_text(browser, served, tiny):
    """The Calibration button draws calibrate's two reliability diagrams (the SVG of `calibrate --html`) and
    its figures for the text in the box: every bar's figures and every bin against `calibrate --json`."""
    text = "The keys on the table are on the table. The keys on the table are here, and the dog is asleep."
    doc = cli_json(["calibrate", text, "--model", str(tiny[0]), "--json"])
    browser.get(served.url + "/")
    browser.find_element("id", "score-text").send_keys(text)
    assert start(browser, "calibrate", "calibrate-go") == "done"
    svgs = browser.execute_script("return Array.from(document.querySelectorAll('#calibrate-view svg'))"
                                  ".map(s => [s.namespaceURI, s.querySelector('title').textContent, "
                                  "Array.from(s.querySelectorAll('rect.bar title')).map(t => t.textContent)])")
    assert [(ns, title) for ns, title, _ in svgs] == [
        ("http://www.w3.org/2000/svg", f"as given: ECE {doc['ece']:.4f}"),
        ("http://www.w3.org/2000/svg", f"at T = {doc['temperature']:.3f}: ECE {doc['ece_at_temperature']:.4f}")]
    bars = [f"({b['lo']:.3f}, {b['hi']:.3f}]: {b['count']:,} positions, confidence {b['confidence']:.4f}, "
            f"accuracy {b['accuracy']:.4f}" for b in doc["bins"] if b["count"]]
    # drawn as the SVG says: the page's own styles (its .bar) must not resize the diagram's bars
    heights = browser.execute_script("return Array.from(document.querySelectorAll('#calibrate-view rect.bar'))"
                                     ".map(r => [r.getBBox().height, parseFloat(r.getAttribute('height'))])")
    assert heights and all(abs(drawn - said) < 0.01 for drawn, said in heights), heights
    assert svgs[0][2] == bars and len(bars) >= 1  # (a random model is sure of nothing: its bins are the lowest)
    rows = browser.execute_script("return Array.from(document.querySelectorAll('#calibrate-view table.bins tr[data-count]'))"
                                  ".map(r => Array.from(r.children).map(c => c.textContent))")
    assert rows == [[f"({b['lo']:.2f}, {b['hi']:.2f}]", f"{b['count']:,}",
                     f"{b['confidence']:.3f}" if b["count"] else "", f"{b['accuracy']:.3f}" if b["count"] else ""]
                    for b in doc["bins"]]
    summary = browser.execute_script("return document.querySelector('#calibrate-view').textContent")
    for figure in (f"ECE {doc['ece']:.4f}", f"Brier {doc['brier']:.4f}", f"NLL {doc['nll']:.4f} nats",
                   f"temperature {doc['temperature']:.4f}", f"{doc['positions']} positions"):
        assert figure in summary
    # the same refusal as score's, shown as the panel's error
    browser.execute_script("document.getElementById('score-text').value = 'x'")
    assert start(browser, "calibrate", "calibrate-go") == "error"
    assert "nothing before it" in browser.find_element("id", "calibrate-status").text
    not_pwned(browser)


def test_served_page_hostile_prompt_and_model(browser, served, control_model):
    browser.get(served.url + "/")
    browser.execute_script("document.getElementById('score-text').value = arguments[0];"
                           "document.getElementById('next-prompt').value = arguments[0];", HOSTILE_TEXT)
    assert start(browser, "score", "score-go") == "done"
    assert start(browser, "next", "next-go") == "done"
    not_pwned(browser)
    assert browser.execute_script("return document.querySelector('#score-view .text').textContent") == \
        safe_text(HOSTILE_TEXT, keep="\n\t")
    hostile = Server(control_model)
    try:
        browser.get(hostile.url + "/")
        browser.execute_script("document.getElementById('next-prompt').value = arguments[0];"
                               "document.getElementById('score-text').value = arguments[0];", "hi \x1b[2J\x07")
        assert start(browser, "next", "next-go") == "done"
        assert start(browser, "score", "score-go") == "done"
        shown = browser.execute_script("return Array.from(document.querySelectorAll('#next-view tr.top'))"
                                       ".map(r => r.children[1].textContent)")
        assert shown[:2] == ["\\x1b", "\\x07"]
        assert controls(browser.execute_script("return document.body.innerText")) == []
        assert "\\x1b[2J\\x07" in browser.execute_script("return document.querySelector('#score-view').textContent")
        not_pwned(browser)
    finally:
        hostile.close()


def test_errors_are_shown(browser, served, tiny, tmp_path):
    from lmhead_cli.serve.page import MAX_TEXT_CHARS

    browser.get(served.url + "/")
    browser.execute_script("document.getElementById('score-text').value = 'ab '.repeat(arguments[0])",
                           MAX_TEXT_CHARS // 3 + 1)
    assert start(browser, "score", "score-go") == "error"
    assert "the page scores at most" in browser.find_element("id", "score-status").text
    browser.execute_script("document.getElementById('score-text').value = ''")
    assert start(browser, "score", "score-go") == "error"
    assert "empty" in browser.find_element("id", "score-status").text
    broken = Server(str(nan_checkpoint(tiny[0], tmp_path)))
    try:
        browser.get(broken.url + "/")
        browser.find_element("id", "score-text").send_keys("The keys on the table")
        assert start(browser, "score", "score-go") == "error"
        assert "non-finite" in browser.find_element("id", "score-status").text
        browser.find_element("id", "next-prompt").send_keys("The keys")
        assert start(browser, "next", "next-go") == "error"
        assert "non-finite" in browser.find_element("id", "next-status").text
    finally:
        broken.close()


def test_api_key(browser, tiny):
    """With --api-key the page asks for the key, keeps it for the tab and sends it."""
    server = Server(str(tiny[0]), "--api-key", "s3cret")
    try:
        browser.get(server.url + "/")
        wait_for(browser, "return !document.getElementById('key-row').hidden", "the key field")
        assert "API key" in browser.find_element("id", "page-status").text
        browser.find_element("id", "key").send_keys("s3cret")
        browser.find_element("id", "key-go").click()
        wait_for(browser, f"return document.getElementById('model-name').textContent === {json.dumps(tiny[0].name)}",
                 "the model's name")
        browser.find_element("id", "next-prompt").send_keys("The keys")
        assert start(browser, "next", "next-go") == "done"
    finally:
        browser.execute_script("sessionStorage.clear()")
        server.close()


def test_render_time_5000_tokens(browser, served):
    """The time from the server's answer to the first frame after the view is built, for a 5,000-token
    text, measured in the browser (performance.now()). Printed and written for the benchmark results
    (to $LMHEAD_PAGE_TIMING when set); never asserted as a time."""
    text = make_text(served.model.tokenizer, 5000, seed=2)
    browser.get(served.url + "/")
    browser.execute_script("document.getElementById('score-text').value = arguments[0]", text)
    assert start(browser, "score", "score-go") == "done"
    timing = browser.execute_script("return window.lmhead.lastRender")
    assert timing["tokens"] == len(served.model.tokenizer.encode_long(text)) >= 5000
    n = browser.execute_script("return document.querySelectorAll('#score-view .text [data-token-id]').length")
    assert n == timing["tokens"]
    line = json.dumps({"test": "page render, 5,000-token text", **timing})
    print(line)
    if os.environ.get("LMHEAD_PAGE_TIMING"):
        with open(os.environ["LMHEAD_PAGE_TIMING"], "a", encoding="utf-8") as f:
            f.write(line + "\n")


def test_screenshot(browser, served, tmp_path):
    """A screenshot of the page with a scored text, a tooltip and the next-token panel; copied to
    $LMHEAD_PAGE_SCREENSHOT when set (docs/page.png is made that way, with the model in
    $LMHEAD_PAGE_SCREENSHOT_MODEL)."""
    from selenium.webdriver.common.action_chains import ActionChains

    model = os.environ.get("LMHEAD_PAGE_SCREENSHOT_MODEL")
    server = Server(model) if model else served
    try:
        browser.set_window_size(1200, 1000)
        browser.get(server.url + "/")
        browser.execute_script("document.getElementById('score-text').value = arguments[0];"
                               "document.getElementById('next-prompt').value = arguments[1];",
                               "In the beginning God created the heaven and the earth. And the earth was "
                               "without form, and void; and darkness was upon the face of the deep. And the "
                               "keys of the kingdom were upon the table.", "And God said, Let there be")
        assert start(browser, "score", "score-go") == "done"
        assert start(browser, "next", "next-go") == "done"
        spans = browser.find_elements("css selector", "#score-view .text [data-rank]")
        ActionChains(browser).move_to_element(spans[len(spans) // 3]).perform()
        tip_text(browser)
        shot = tmp_path / "page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if os.environ.get("LMHEAD_PAGE_SCREENSHOT"):
            shutil.copy(shot, os.environ["LMHEAD_PAGE_SCREENSHOT"])
    finally:
        if server is not served:
            server.close()

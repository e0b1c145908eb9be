"""The built-in web page in a real browser: headless Debian chromium driven by Playwright.

One browser and one tiny engine (several KV blocks per request, prefix caching, an API key)
for the module. What the page shows is checked against what the test did and against the
server itself: the streamed reply equals the same request made without the page, the slot
table and the block map follow requests the test starts, and a repeated prompt's blocks show
up as cached. Every page must finish without console errors.
"""

import json
import os

import pytest
import requests

import engine_state_fixtures as fx

CHROMIUM = os.environ.get("JAXSERVE_CHROMIUM", "/usr/bin/chromium")
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/setup.sh --test installs Debian's)",
                allow_module_level=True)
pytestmark = pytest.mark.browser
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def server():
    engine = fx.tiny_engine()
    loop = fx.start_loop(engine, state_interval_s=0.05)  # short requests are seen too
    with fx.serve(loop) as s:
        s.loop, s.engine = loop, engine
        yield s
    loop.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser, url, key=fx.KEY, viewport=(1280, 860)):
    """A fresh tab (own sessionStorage) on the page; `.errors` collects console errors."""
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    if key is not None:
        context.add_init_script(f"sessionStorage.setItem('jaxserve.apiKey', {json.dumps(key)})")
    page = context.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(url + "/?poll_ms=80")
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server.url)
    yield page
    errors = list(page.errors)
    page.context.close()
    assert errors == [], errors


def counts(page) -> dict:
    return json.loads(page.get_attribute("#block-map", "data-counts") or "{}")


def test_page_and_its_files_are_served(server):
    r = requests.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and "text/html" in r.headers["Content-Type"]
    for name in ("api.js", "chat.js", "engine.js", "charts.js", "main.js", "style.css"):
        assert requests.get(f"{server.url}/ui/{name}", timeout=30).status_code == 200, name
    assert requests.get(server.url + "/ui/missing.js", timeout=30).status_code == 404


def test_chat_streams_the_same_reply_as_a_plain_request(page, server):
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "16")
    page.fill("#seed", "7")
    page.fill("#prompt", "Name a colour.")
    page.press("#prompt", "Enter")
    page.wait_for_selector("li.msg.assistant[data-done=true]", timeout=WAIT_MS)
    reply = page.locator("li.msg.assistant").first
    updates = int(reply.get_attribute("data-updates"))
    text = reply.locator(".text").inner_text()
    stats = reply.locator(".stats").inner_text()
    body = {"model": fx.MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0, "max_tokens": 16, "seed": 7, "top_p": 1, "top_k": -1, "n": 1}
    ref = requests.post(server.url + "/v1/chat/completions", data=json.dumps(body),
                        headers=fx.headers(), timeout=60).json()
    assert text == ref["choices"][0]["message"]["content"].strip() or \
        text == ref["choices"][0]["message"]["content"]
    n = ref["usage"]["completion_tokens"]
    assert updates > 1 and n > 1  # streamed: the text arrived in several updates
    assert "TTFT" in stats and f"{n} tokens" in stats, stats


def test_engine_view_follows_requests_and_frees_blocks(page, server):
    page.click("#tab-engine")
    page.wait_for_function("Number(document.getElementById('view-engine').dataset.updates) > 1",
                           timeout=WAIT_MS)
    # The engine is held once two of the requests decode together, until the page has shown
    # them: a page that polls slowly (a loaded machine) cannot miss them.
    with fx.held_once(server.engine, lambda e: fx.decoding(e) >= 2) as wait_held:
        threads = fx.in_background(server.url, [f"request {i} says hello" for i in range(3)],
                                   110)
        wait_held()
        page.wait_for_function("document.querySelectorAll('#slots tbody tr[data-request-id]')"
                               ".length >= 2", timeout=WAIT_MS)
        rows, busy = page.evaluate(  # one read: the page redraws between two calls
            "[document.querySelectorAll('#slots tbody tr[data-request-id]').length,"
            " JSON.parse(document.getElementById('block-map').dataset.counts)]")
        assert rows >= 2 and busy["used"] + busy["cached"] + busy["shared"] >= rows
    for t in threads:
        t.join(120)
    page.wait_for_function("document.querySelector('#slots tbody td.empty') !== null",
                           timeout=WAIT_MS)
    page.wait_for_function("(() => { const c = JSON.parse(document.getElementById('block-map')"
                           ".dataset.counts); return c.used + c.cached + c.shared === 0; })()",
                           timeout=WAIT_MS)
    assert int(page.locator("#card-running .value").inner_text()) == 0


def test_a_repeated_prompt_shows_cached_blocks(page, server):
    page.click("#tab-engine")
    fx.complete(server.url, fx.SHARED_PREFIX, 4)
    fx.wait_idle(server.loop)
    cached = sum(fx.fresh_state(server.url)["blocks"]["cached"])  # what the server says
    assert cached >= 2  # the prompt's full blocks, all free now
    page.wait_for_function("JSON.parse(document.getElementById('block-map').dataset.counts"
                           f" || '{{}}').evictable === {cached}", timeout=WAIT_MS)
    # 86 prompt tokens + 36 fit in 128. The engine is held once two of the requests decode
    # together, until the page has shown them: a page that polls slowly cannot miss them.
    with fx.held_once(server.engine, lambda e: fx.decoding(e) >= 2) as wait_held:
        threads = fx.in_background(server.url, [fx.SHARED_PREFIX] * 8, 36)
        wait_held()
        # The cached prefix in use again (shared by the requests running together).
        page.wait_for_function("JSON.parse(document.getElementById('block-map').dataset"
                               ".counts).cached_in_use > 0", timeout=WAIT_MS)
    for t in threads:
        t.join(120)
    # All done: the page shows the blocks freed, then the hit rate of what ran.
    page.wait_for_function("(() => { const c = JSON.parse(document.getElementById('block-map')"
                           ".dataset.counts); return c.used + c.cached + c.shared === 0; })()",
                           timeout=WAIT_MS)
    hit_rate = page.locator("#card-hits .value").inner_text()
    assert float(hit_rate.rstrip("%")) > 0


def test_the_page_asks_for_the_api_key(browser, server):
    page = open_page(browser, server.url, key=None)
    page.wait_for_selector("#key-dialog[open]", timeout=WAIT_MS)
    page.fill("#key-input", fx.KEY)
    page.click("#key-save")
    page.wait_for_function(f"document.getElementById('model-name').textContent"
                           f".includes({json.dumps(fx.MODEL)})", timeout=WAIT_MS)
    page.click("#tab-engine")
    page.wait_for_function("document.getElementById('engine-status').textContent"
                           ".startsWith('updated')", timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.getItem('jaxserve.apiKey')") == fx.KEY
    # The refusals before the key was given are the only errors (the browser logs a 401).
    assert all("401" in e for e in page.errors), page.errors
    page.context.close()


def test_a_wrong_key_is_refused_and_asked_again(browser, server):
    page = open_page(browser, server.url, key="wrong")
    page.wait_for_selector("#key-dialog[open]", timeout=WAIT_MS)
    assert "API key" in page.inner_text("#key-reason")
    page.context.close()


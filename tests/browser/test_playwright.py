"""Playwright for Python against `ember serve`'s CDP route (driven by tests/browser.rs).

Environment: EMBER_URL, EMBER_TOKEN (the server's), SANDBOX_A / SANDBOX_B (browser sandboxes),
TOKEN_A (sandbox A's own access token), PAGE_URL (the test page, through the sandboxes'
policy), DENIED_URLS (space-separated: pages the policy must keep out), HOST_CHROMIUM (the
host's Chromium binary, for the live view), OUT_DIR (PNGs are written there).
Prints `OK <check>` per check; exits 1 with `FAIL <check>: <why>` on the first failure.
"""

import os
import sys
import time

# Generous limits: under kvm_pvm (no hardware virtualization) a sandbox's first navigation,
# screenshot or new page costs its guest tens of seconds of emulated kernel work.
LIMIT = 300_000

from playwright.sync_api import Error, sync_playwright

URL = os.environ["EMBER_URL"]
TOKEN = os.environ["EMBER_TOKEN"]
A = os.environ["SANDBOX_A"]
B = os.environ["SANDBOX_B"]
TOKEN_A = os.environ["TOKEN_A"]
PAGE = os.environ["PAGE_URL"]
DENIED = os.environ["DENIED_URLS"].split()
OUT = os.environ["OUT_DIR"]
HOST_CHROMIUM = os.environ["HOST_CHROMIUM"]


def check(cond, what, why=""):
    if not cond:
        print(f"FAIL {what}: {why}", flush=True)
        sys.exit(1)
    print(f"OK {what}", flush=True)


with sync_playwright() as p:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # What the README shows: connect, take the page the sandbox's browser already has.
    t0 = time.monotonic()
    browser = p.chromium.connect_over_cdp(f"{URL}/v1/sandboxes/{A}/cdp", headers=auth, timeout=LIMIT)
    print(f"connect_over_cdp: {time.monotonic() - t0:.3f}s", flush=True)
    check(len(browser.contexts) >= 1 and browser.contexts[0].pages, "a page is already open")
    page = browser.contexts[0].pages[0]
    browser.contexts[0].set_default_timeout(LIMIT)
    check(page.url == "about:blank", "the page is the template's blank page", page.url)

    # Open the test page, fill the form, read the result.
    page.goto(PAGE, timeout=LIMIT)
    check(page.title() == "ember test page", "test page loaded", page.title())
    page.fill("#q", "ember")
    page.click("#go")
    page.wait_for_selector("#out", timeout=LIMIT)
    text = page.inner_text("#out")
    check(text == "hello, ember", "form result read", text)
    page.screenshot(path=f"{OUT}/playwright.png")
    check(os.path.getsize(f"{OUT}/playwright.png") > 0, "screenshot written")

    # A cookie in A; B must not see it (nor A's pages).
    page.goto(PAGE + "set-cookie?v=sandbox-a", timeout=LIMIT)
    page.goto(PAGE + "cookie", timeout=LIMIT)
    check("who=sandbox-a" in page.inner_text("body"), "A keeps its cookie", page.inner_text("body"))
    browser_b = p.chromium.connect_over_cdp(f"{URL}/v1/sandboxes/{B}/cdp", headers=auth, timeout=LIMIT)
    ctx_b = browser_b.contexts[0]
    ctx_b.set_default_timeout(LIMIT)
    urls_b = [pg.url for pg in ctx_b.pages]
    check(all("set-cookie" not in u and "cookie" not in u for u in urls_b), "B does not see A's pages", urls_b)
    check(ctx_b.cookies() == [], "B's browser has no cookies", ctx_b.cookies())
    page_b = ctx_b.pages[0]
    page_b.goto(PAGE + "cookie", timeout=LIMIT)
    body_b = page_b.inner_text("body")
    check(body_b == "no cookie", "B's request carries no cookie of A's", body_b)
    # And the other way round: what B does is not in A.
    page_b.goto(PAGE + "set-cookie?v=sandbox-b", timeout=LIMIT)
    page.goto(PAGE + "cookie", timeout=LIMIT)
    body_a = page.inner_text("body")
    check("sandbox-b" not in body_a and "who=sandbox-a" in body_a, "A does not get B's cookie", body_a)
    # Not browser_b.close(): over CDP that sends Browser.close and ends the sandbox's Chromium.

    # The policy: denied pages fail inside the browser.
    for url in DENIED:
        try:
            page.goto(url, timeout=LIMIT)
            check(False, f"denied {url} fails", "it loaded: " + page.content()[:200])
        except Error as e:
            print(f"denied {url}: {str(e).splitlines()[0]}", flush=True)
            check(True, f"denied {url} fails")
            # Chromium then commits its error page (in a renderer of its own, which takes a
            # while to start under kvm_pvm); a goto before that commit is interrupted by it.
            page.wait_for_url(lambda u: u.startswith("chrome-error://"), timeout=LIMIT)

    # Leave the test page's colours on screen for the live view and the screenshot API (a
    # late error-page commit of a denied page may still interrupt the first attempt).
    for attempt in range(3):
        try:
            page.goto(PAGE + "result?q=view", timeout=LIMIT)
            break
        except Error as e:
            if "interrupted by another navigation" not in str(e) or attempt == 2:
                raise
            print(f"retrying the result page: {str(e).splitlines()[0]}", flush=True)
            page.wait_for_load_state(timeout=LIMIT)
    page.wait_for_selector("#out")

    # The live view, in the host's headless Chromium.
    host = p.chromium.launch(executable_path=HOST_CHROMIUM, args=["--no-sandbox"])
    view = host.new_page(viewport={"width": 1400, "height": 900})
    view.goto(f"{URL}/v1/sandboxes/{A}/view?token={TOKEN_A}", timeout=LIMIT)
    view.wait_for_function(
        "document.getElementById('status').textContent.startsWith('live')"
        " && document.getElementById('screen').naturalWidth > 0",
        timeout=LIMIT,
    )
    # A change on the sandbox's page arrives as a new frame.
    frames_before = view.inner_text("#status")
    page.evaluate("document.getElementById('out').textContent = 'changed'")
    time.sleep(2)
    view.screenshot(path=f"{OUT}/view.png")
    print(f"live view: {frames_before} -> {view.inner_text('#status')}", flush=True)
    host.close()
# Leaving sync_playwright() disconnects; A's browser keeps running for the checks that follow.
print("DONE", flush=True)

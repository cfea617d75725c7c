"""The dashboard (`/ui` of `ember serve`) driven by Playwright for Python in the host's headless
Chromium. Run by tests/ui.rs, which starts the server and passes:

  UI_URL         the server (http://127.0.0.1:PORT)
  EMBER_TOKEN    its bearer token (typed into the sign-in form; used for the API calls here)
  HOST_CHROMIUM  the Chromium binary
  UI_SHOTS       a directory for one screenshot per page (tests/ui.rs checks they are not blank)
  UI_TEMPLATE    the template with pandas (python-data)
  UI_SEEDED, UI_SEEDED_TEMPLATE
                 how many ended sandboxes of which template tests/ui.rs put in the store
                 (the list's paging at scale)

Prints figures (page weight, first paint, list update latency) and `all passed` at the end.
"""

import gzip
import json
import os
import socket
import time
import urllib.error
import urllib.request

from playwright.sync_api import expect, sync_playwright

URL = os.environ["UI_URL"]
TOKEN = os.environ["EMBER_TOKEN"]
CHROMIUM = os.environ["HOST_CHROMIUM"]
SHOTS = os.environ["UI_SHOTS"]
TEMPLATE = os.environ.get("UI_TEMPLATE", "python-data")
SEEDED = int(os.environ.get("UI_SEEDED", "0"))
SEEDED_TEMPLATE = os.environ.get("UI_SEEDED_TEMPLATE", "")
T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def http(method, path, body=None, bearer=True, headers=None):
    """(status, parsed JSON or bytes) of a request to the server."""
    h = dict(headers or {})
    if bearer:
        h["Authorization"] = f"Bearer {TOKEN}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(URL + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


TERM_HAS_LINE = """(want) => {
    const t = window.emberTerm;
    if (!t) return false;
    const b = t.buffer.active;
    for (let i = 0; i < b.length; i++) {
        const l = b.getLine(i);
        if (l && l.translateToString(true).trim() === want) return true;
    }
    return false;
}"""


def ws_status(host, path, headers):
    """The HTTP status of a WebSocket handshake with these headers (then the socket is closed)."""
    h, port = host.rsplit(":", 1)
    with socket.create_connection((h, int(port)), timeout=30) as s:
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
                 "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        first = s.recv(4096).split(b"\r\n", 1)[0].decode()
        status = int(first.split()[1])
        if status == 101:
            s.recv(4096)  # the shell's first output: it started; closing the socket ends it
    if status == 101:
        time.sleep(1)  # the server kills and forgets the shell
    return status


def shot(page, name):
    path = os.path.join(SHOTS, f"{name}.png")
    page.screenshot(path=path, full_page=False)
    log(f"screenshot {name}: {os.path.getsize(path)} bytes")


def main():
    # Page weight: what a first visit downloads (no compression, nothing cached).
    # The server sends them uncompressed; the gzip figure (level 9) is what a compressing
    # proxy in front would send. No fonts: the page uses the system's.
    bodies = {p: urllib.request.urlopen(URL + p).read() for p in ("/ui/", "/ui/app.js", "/ui/app.css")}
    weight = {p: len(b) for p, b in bodies.items()}
    gz = sum(len(gzip.compress(b, 9)) for b in bodies.values())
    print(f"FIGURE page_weight_bytes={sum(weight.values())} gzip={gz} {weight}")
    vbodies = {p: urllib.request.urlopen(URL + p).read()
               for p in ("/ui/vendor/xterm.js", "/ui/vendor/addon-fit.js", "/ui/vendor/xterm.css")}
    vendor = {p: len(b) for p, b in vbodies.items()}
    vgz = sum(len(gzip.compress(b, 9)) for b in vbodies.values())
    print(f"FIGURE vendor_weight_bytes={sum(vendor.values())} gzip={vgz} {vendor}")
    print(f"FIGURE total_weight_bytes={sum(weight.values()) + sum(vendor.values())} gzip={gz + vgz}")

    # Without the session cookie, data and actions are refused before any call.
    for method, path in [("GET", "/ui/api/overview"), ("GET", "/ui/api/sandboxes"),
                         ("POST", "/ui/api/sandboxes/0000000000000000/pause")]:
        status, body = http(method, path, bearer=False)
        assert status == 401, (method, path, status, body)
    # The bearer token is not a session either.
    status, _ = http("GET", "/ui/api/overview")
    assert status == 401, status
    log("no session: 401")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        ctx = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        # A slow kvm_pvm host beside another lane's guests: every wait gets minutes, not
        # Playwright's 5 s (expect) and 30 s (actions) defaults.
        ctx.set_default_timeout(120000)
        expect.set_options(timeout=60000)
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: d.accept())

        # ----- sign-in
        page.goto(URL + "/ui/")
        expect(page.locator("#signin-form")).to_be_visible()
        shot(page, "signin")
        page.fill("#token", "not-the-token")
        page.click("#signin-button")
        expect(page.locator("#signin-error")).to_be_visible()
        assert not [c for c in ctx.cookies() if c["name"] == "ember_ui"], ctx.cookies()
        page.fill("#token", TOKEN)
        page.click("#signin-button")
        expect(page.locator("#c-running")).to_be_visible()
        cookie = [c for c in ctx.cookies() if c["name"] == "ember_ui"]
        assert len(cookie) == 1, ctx.cookies()
        c = cookie[0]
        assert c["httpOnly"] and c["sameSite"] == "Strict" and c["path"] == "/", c
        assert TOKEN not in c["value"]
        seen = page.evaluate("location.href + JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + document.cookie")
        assert TOKEN not in seen and "ember_ui" not in seen, seen
        log("signed in (cookie HttpOnly, SameSite=Strict; no token in URL or storage)")

        # ----- overview: first paint of a fresh load, from the server on loopback
        fresh = ctx.new_page()
        fresh.goto(URL + "/ui/#/overview")
        fresh.wait_for_selector("#c-running")
        shown = fresh.evaluate("performance.now()")
        paint = fresh.evaluate(
            "Object.fromEntries(performance.getEntriesByType('paint').map(e => [e.name, e.startTime]))")
        nav = fresh.evaluate("performance.getEntriesByType('navigation')[0].toJSON()")
        print(f"FIGURE overview_first_paint_ms={paint.get('first-paint', -1):.1f} "
              f"first_contentful_paint_ms={paint.get('first-contentful-paint', -1):.1f} "
              f"dom_content_loaded_ms={nav['domContentLoadedEventEnd']:.1f} "
              f"overview_data_shown_ms<={shown:.1f}")
        fresh.close()
        time.sleep(3.5)  # a few samples for the charts
        assert page.locator("svg.chart polyline").count() >= 3
        shot(page, "overview")

        # ----- the list updates without a reload
        page.goto(URL + "/ui/#/sandboxes")
        expect(page.locator("#page-info")).to_contain_text("page 1")
        page.evaluate("window.__noReload = 1")
        status, sb = http("POST", "/v1/sandboxes", {"template": TEMPLATE, "timeout_secs": 600,
                                                    "metadata": {"suite": "ui", "run": str(os.getpid())}})
        assert status == 201, (status, sb)
        sid = sb["id"]
        t = time.monotonic()
        row = page.locator(f'tr[data-id="{sid}"]')
        expect(row).to_be_visible(timeout=180000)
        print(f"FIGURE list_update_ms={(time.monotonic() - t) * 1000:.0f} (sandbox created through the API → its row)")
        assert page.evaluate("window.__noReload") == 1, "the page reloaded"
        assert page.locator("#sandbox-rows tr").count() <= 50
        page.select_option("#f-template", TEMPLATE)
        expect(row).to_be_visible()
        page.select_option("#f-state", "paused")
        expect(row).to_have_count(0)
        page.select_option("#f-state", "running")
        expect(row).to_be_visible()
        page.fill("#f-metadata", f"suite=ui,run={os.getpid()}")
        page.press("#f-metadata", "Enter")
        expect(row).to_be_visible()
        page.fill("#f-metadata", "suite=other")
        page.press("#f-metadata", "Enter")
        expect(row).to_have_count(0)
        r = page.request.get(f"{URL}/ui/api/sandboxes?metadata=novalue")
        assert r.status == 400, (r.status, r.text())
        page.fill("#f-metadata", "")
        page.press("#f-metadata", "Enter")
        expect(row).to_be_visible()
        shot(page, "sandboxes")
        log(f"sandbox {sid} listed; filters work")

        # ----- the list at scale: SEEDED ended sandboxes, paged on the server
        if SEEDED:
            pages = -(-SEEDED // 50)
            page.select_option("#f-state", "all")
            page.select_option("#f-template", SEEDED_TEMPLATE)
            info = page.locator("#page-info")
            expect(info).to_contain_text(f"page 1 of {pages} · {SEEDED} sandboxes")
            assert page.locator("#sandbox-rows tr").count() == 50
            first = page.locator("#sandbox-rows tr").first.get_attribute("data-id")
            page.click("#next")
            expect(info).to_contain_text(f"page 2 of {pages}")
            assert page.locator("#sandbox-rows tr").count() == 50
            assert page.locator("#sandbox-rows tr").first.get_attribute("data-id") != first
            # The whole page holds one page of rows, not one per sandbox.
            assert page.locator("tr[data-id]").count() == 50
            r = page.request.get(f"{URL}/ui/api/sandboxes?state=all&template={SEEDED_TEMPLATE}&page={pages - 1}")
            last = r.json()
            assert last["total"] == SEEDED and last["page"] == pages - 1, last
            assert len(last["items"]) == SEEDED - 50 * (pages - 1), len(last["items"])
            t = time.monotonic()
            r = page.request.get(f"{URL}/ui/api/sandboxes?state=all&page=0")
            print(f"FIGURE list_page_ms={(time.monotonic() - t) * 1000:.0f} (one page of {r.json()['total']} sandboxes)")
            log(f"{SEEDED} ended sandboxes: {pages} pages of 50 rows")
            page.select_option("#f-state", "live")
            page.select_option("#f-template", "")

        # ----- the sandbox page
        row.locator("a").click()
        state = page.locator("#sb-state")
        expect(state).to_have_attribute("data-state", "running")
        page.fill("#cell", "import pandas as pd; df = pd.DataFrame({'a':[1,2,3]}); df.describe()")
        page.click("#run-cell")
        table = page.locator("#cell-out .rich-html table")
        expect(table).to_be_visible(timeout=180000)
        expect(table).to_contain_text("mean")
        expect(table).to_contain_text("2.0")
        log("cell: describe() shown as an HTML table")

        # Guest HTML cannot run script in the page.
        page.fill("#cell", "from IPython.display import HTML\n"
                  "HTML('<table><tr><td onclick=\"window.pwned=1\">x</td></tr></table>"
                  "<script>window.pwned=2</script><img src=x onerror=\"window.pwned=3\">')")
        page.click("#run-cell")
        expect(page.locator("#cell-out .rich-html td")).to_have_text("x", timeout=120000)
        page.locator("#cell-out .rich-html td").click()
        assert page.evaluate("window.pwned") is None
        assert page.locator("#cell-out .rich-html [onclick], #cell-out script, #cell-out .rich-html img").count() == 0
        # A PNG result.
        page.fill("#cell", "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
        page.click("#run-cell")
        img = page.locator("#cell-out img")
        expect(img).to_be_visible(timeout=180000)
        assert page.evaluate("document.querySelector('#cell-out img').naturalWidth") > 100
        log("cell: sanitized HTML, PNG image")

        page.fill("#cmd", "echo hi")
        page.click("#run-cmd")
        out = page.locator("#cmd-out pre.stdout")
        expect(out).to_be_visible(timeout=120000)
        assert out.inner_text().strip() == "hi", out.inner_text()
        expect(page.locator("#cmd-out .status")).to_contain_text('exit {"code":0}')
        log("command: echo hi → hi")

        # An artifact: written, collected, downloaded.
        page.fill("#cmd", "mkdir -p /workspace/outputs && echo artifact-body > /workspace/outputs/report.txt")
        page.click("#run-cmd")
        expect(page.locator("#cmd-out .status")).to_contain_text('exit {"code":0}', timeout=120000)
        page.click("#collect")
        link = page.locator("#artifacts a", has_text="report.txt")
        expect(link).to_be_visible(timeout=120000)
        with page.expect_download() as dl:
            link.click()
        with open(dl.value.path(), "rb") as f:
            got = f.read()
        assert got == b"artifact-body\n", got
        assert dl.value.suggested_filename == "report.txt", dl.value.suggested_filename
        log("artifact downloaded")

        # ----- resources over time: samples the server takes while the page polls
        page.wait_for_function(
            "() => Number(document.querySelector('#res-cpu polyline')?.dataset.points || 0) >= 3", timeout=120000)
        r = page.request.get(f"{URL}/ui/api/sandboxes/{sid}/usage").json()
        assert len(r["samples"]) >= 3 and r["idle"] is None, r
        assert all(x["mem_used_bytes"] > 0 for x in r["samples"]), r["samples"]
        assert r["samples"][-1]["at_ms"] > r["samples"][0]["at_ms"], r["samples"]
        pts = page.locator("#res-mem polyline").first.get_attribute("points").split()
        assert len(pts) >= 3 and len({p.split(",")[1] for p in pts}) >= 1, pts
        log(f"resources: {len(r['samples'])} samples, memory {r['samples'][-1]['mem_used_bytes'] >> 20} MiB")

        # ----- the serial console's tail shows a line the guest wrote to it (as text)
        marker = "ui-serial-<b>marker</b>-" + str(int(time.time()))
        status, _ = http("POST", f"/v1/sandboxes/{sid}/exec", {
            "argv": ["/bin/sh", "-c", f"printf '%s\\n' '{marker}' > /dev/ttyS0"], "user": "root"})
        assert status == 200, status
        t = time.monotonic()
        expect(page.locator("#log-tail")).to_contain_text(marker, timeout=90000)
        assert page.locator("#log-tail b").count() == 0, "guest bytes became markup"
        log(f"serial tail: the guest's line shown as text ({time.monotonic() - t:.1f} s)")
        page.select_option("#log-kind", "vmm")
        expect(page.locator("#log-note")).to_contain_text("bytes", timeout=180000)
        # A healthy VMM may have logged nothing (its log holds warnings and errors).
        r = page.request.get(f"{URL}/ui/api/sandboxes/{sid}/log?kind=vmm")
        assert r.status == 200, r.text()
        vmm = r.json()
        assert vmm["size"] == len(vmm["text"].encode()) or vmm["cut"], vmm
        r = page.request.get(f"{URL}/ui/api/sandboxes/{sid}/log?kind=kernel")
        assert r.status == 400, (r.status, r.text())
        page.select_option("#log-kind", "serial")
        # Not a browser sandbox: no live view.
        expect(page.locator("#live-view-box")).to_be_hidden()
        log(f"VMM log tail: {vmm['size']} bytes")

        # ----- the terminal: a shell on a PTY over a WebSocket (xterm.js)
        t = time.monotonic()
        page.click("#open-term")
        expect(page.locator("#term-state")).to_have_text("connected", timeout=120000)
        page.locator("#term .xterm-screen").click()
        page.keyboard.type("echo hi")
        page.keyboard.press("Enter")
        # A line that is exactly `hi`: the command's output, not the echo of what was typed.
        page.wait_for_function(TERM_HAS_LINE, arg="hi", timeout=120000)
        expect(page.locator("#term .xterm-rows")).to_contain_text("echo hi")
        log(f"terminal: echo hi → hi ({time.monotonic() - t:.1f} s)")
        # A resize reaches the PTY: `stty size` answers the terminal's rows and columns.
        page.set_viewport_size({"width": 1000, "height": 900})
        page.wait_for_timeout(300)
        rows, cols = page.evaluate("[window.emberTerm.rows, window.emberTerm.cols]")
        page.keyboard.type("stty size")
        page.keyboard.press("Enter")
        page.wait_for_function(TERM_HAS_LINE, arg=f"{rows} {cols}", timeout=120000)
        page.set_viewport_size({"width": 1280, "height": 900})
        log(f"terminal: resized to {cols}x{rows}")
        # A flood (100 kB of output) goes through, and the shell still answers after it.
        t = time.monotonic()
        page.keyboard.type("head -c 100000 /dev/zero | tr '\\0' x; echo; echo flood-$((6*7))")
        page.keyboard.press("Enter")
        try:
            page.wait_for_function(TERM_HAS_LINE, arg="flood-42", timeout=120000)
        except Exception:
            shot(page, "flood")
            print("DEBUG", page.evaluate("""() => { const b = window.emberTerm.buffer.active; const out = [];
                for (let i = Math.max(0, b.length - 8); i < b.length; i++) out.push(b.getLine(i).translateToString(true));
                return JSON.stringify({len: b.length, base: b.baseY, out}); }"""))
            raise
        log(f"terminal: 100 kB of output shown in {time.monotonic() - t:.1f} s")
        shot(page, "terminal")
        # Without the CSRF subprotocol (the page's own origin): refused.
        closed = page.evaluate("""(url) => new Promise((done) => {
            const ws = new WebSocket(url, ['ember-terminal']);
            ws.onopen = () => { ws.close(); done('open'); };
            ws.onerror = () => done('refused');
        })""", URL.replace("http://", "ws://") + f"/ui/api/sandboxes/{sid}/terminal")
        assert closed == "refused", closed
        # A foreign Origin (which a browser page elsewhere would send): refused before the upgrade.
        session_csrf = page.evaluate("fetch('/ui/api/session').then((r) => r.json()).then((j) => j.csrf)")
        cookie_value = [c for c in ctx.cookies() if c["name"] == "ember_ui"][0]["value"]
        host = URL.split("://", 1)[1]
        def handshake(origin, csrf_token):
            protocols = "ember-terminal" + (f", csrf.{csrf_token}" if csrf_token else "")
            return ws_status(host, f"/ui/api/sandboxes/{sid}/terminal", {
                "Origin": origin, "Cookie": f"ember_ui={cookie_value}",
                "Sec-WebSocket-Protocol": protocols})
        assert handshake("http://evil.example", session_csrf) == 403
        assert handshake(f"http://{host}", None) == 403
        assert handshake(f"http://{host}", "0" * 64) == 403
        assert handshake(f"http://{host}", session_csrf) == 101
        log("terminal WebSocket: foreign Origin 403, no CSRF 403, both right 101")
        # The socket's own throughput, without xterm.js: 200 kB of output, bytes counted.
        rate = page.evaluate("""([url, csrf]) => new Promise((done) => {
            const ws = new WebSocket(url, ['ember-terminal', `csrf.${csrf}`]);
            ws.binaryType = 'arraybuffer';
            let n = 0, t0 = 0, tail = '';
            const dec = new TextDecoder();
            ws.onopen = () => { t0 = performance.now();
                ws.send(new TextEncoder().encode("head -c 200000 /dev/zero | tr '\\\\0' x; echo; echo done-$((6*7))\\r")); };
            ws.onmessage = (ev) => {
                if (typeof ev.data === 'string') return;
                n += ev.data.byteLength;
                tail = (tail + dec.decode(ev.data)).slice(-64);
                if (/\\ndone-42/.test(tail)) { ws.close(); done({ bytes: n, ms: performance.now() - t0 }); }
            };
            setTimeout(() => { ws.close(); done({ bytes: n, ms: -1 }); }, 30000);
        })""", [URL.replace("http://", "ws://") + f"/ui/api/sandboxes/{sid}/terminal", session_csrf])
        print(f"FIGURE terminal_socket_bytes={rate['bytes']} ms={rate['ms']:.0f}")
        assert rate["ms"] > 0 and rate["bytes"] > 200000, rate
        page.click("#open-term")  # closes it (and the shell)
        expect(page.locator("#term-state")).to_have_text("")
        expect(page.locator("#audit")).to_contain_text("exec")
        expect(page.locator("#history")).to_contain_text("running")
        shot(page, "sandbox")
        page.screenshot(path=os.path.join(SHOTS, "sandbox_full.png"), full_page=True)  # for a look

        # ----- CSRF: the session alone does not allow actions
        r = page.request.post(f"{URL}/ui/api/sandboxes/{sid}/pause")
        assert r.status == 403, (r.status, r.text())
        r = page.request.post(f"{URL}/ui/api/sandboxes/{sid}/pause", headers={"x-ember-csrf": "0" * 64})
        assert r.status == 403, (r.status, r.text())
        assert http("GET", f"/v1/sandboxes/{sid}")[1]["state"] == "running"
        # The cookie is not the API's credential.
        r = page.request.get(f"{URL}/v1/sandboxes")
        assert r.status == 401, r.status
        log("no CSRF token: 403; cookie on the API: 401")

        # ----- pause, resume (each confirmed in a dialog)
        page.click("#pause")
        expect(state).to_have_attribute("data-state", "paused", timeout=180000)
        t = time.monotonic()
        page.click("#resume")
        expect(state).to_have_attribute("data-state", "running", timeout=180000)
        log(f"paused, resumed ({time.monotonic() - t:.1f} s)")
        expect(page.locator("#history")).to_contain_text("paused")

        # ----- fork (confirmed) and a named snapshot (asked for in a prompt; empty: generated)
        t = time.monotonic()
        page.click("#fork")
        child = page.locator("#fork-result a")
        expect(child).to_be_visible(timeout=180000)
        kid = child.inner_text()
        assert http("GET", f"/v1/sandboxes/{kid}")[1]["forked_from"] == sid
        log(f"forked: {kid} ({time.monotonic() - t:.1f} s)")
        status, _ = http("DELETE", f"/v1/sandboxes/{kid}")
        assert status == 200, status
        t = time.monotonic()
        page.click("#snapshot")
        expect(page.locator("#fork-result")).to_contain_text("snapshot ", timeout=180000)
        snap_name = page.locator("#fork-result").get_attribute("data-snapshot")
        names = [x["name"] for x in http("GET", "/v1/snapshots")[1]]
        assert snap_name in names, (snap_name, names)
        status, _ = http("DELETE", f"/v1/snapshots/{snap_name}")
        assert status == 200, status
        log(f"snapshot {snap_name} taken ({time.monotonic() - t:.1f} s), then deleted")

        # ----- overview: creates per minute and create latency from the server's counters
        page.goto(URL + "/ui/#/overview")
        page.wait_for_function("() => window.emberSamples.some((p) => p.cpm > 0 && p.lat > 0)", timeout=180000)
        lat = page.evaluate("window.emberSamples[window.emberSamples.length - 1].lat")
        assert page.locator("#chart-cpm polyline").count() == 1 and page.locator("#chart-lat polyline").count() == 1
        log(f"overview: creates/min and create latency charted (last mean {lat:.0f} ms)")

        # ----- templates
        page.goto(URL + "/ui/#/templates")
        expect(page.locator("#template-rows")).to_contain_text(TEMPLATE)
        # A build of a cached template: its log streams in and it ends `done`, in seconds.
        t = time.monotonic()
        page.fill("#build-name", "default")
        page.click("#build")
        expect(page.locator("#build-state")).to_have_attribute("data-state", "done", timeout=180000)
        expect(page.locator("#build-log")).to_contain_text("up to date")
        expect(page.locator("#build-log")).to_contain_text("done: default")
        log(f"template build (cached): {page.locator('#build-log span').count()} log lines, "
            f"{time.monotonic() - t:.1f} s")
        shot(page, "templates")
        # A recipe that does not exist: its error in the log.
        page.fill("#build-name", "no-such-recipe")
        page.click("#build")
        expect(page.locator("#build-state")).to_have_attribute("data-state", "failed", timeout=120000)
        expect(page.locator("#build-log")).to_contain_text("error")
        expect(page.locator("#build-log")).to_contain_text("no-such-recipe")
        log("template build of an unknown recipe: its error shown")
        # Without the CSRF token: refused before any build.
        r = page.request.post(f"{URL}/ui/api/templates/default/build")
        assert r.status == 403, r.status

        # ----- kill (confirmed), then sign-out
        page.goto(URL + f"/ui/#/sandboxes/{sid}")
        expect(state).to_have_attribute("data-state", "running")
        page.click("#kill")
        expect(state).to_have_attribute("data-state", "stopped", timeout=180000)
        page.click("#signout")
        expect(page.locator("#signin-form")).to_be_visible()
        r = page.request.get(f"{URL}/ui/api/overview")
        assert r.status == 401, r.status
        assert not errors, errors
        browser.close()
    log("signed out")
    print("all passed")


if __name__ == "__main__":
    main()

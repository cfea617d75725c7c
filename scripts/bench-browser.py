#!/usr/bin/env python3
"""Browser sandbox figures against a running `ember serve` (docs/browser.md).

Per run: POST /v1/sandboxes (template `browser`) → Playwright `connect_over_cdp` → the first
page loaded (`page.goto` of a `data:` page, so no network is needed and the policy can stay
`none`); then the sandbox idles for a few seconds and its VMM's memory is read
(/proc/PID/smaps_rollup of the sandbox's `pid`: RSS and PSS; run it as root on the server's
host). Prints one JSON line per run and a summary (median, p95).

Run with the Playwright venv that scripts/browser-clients.sh installs:

    eval "$(bash scripts/browser-clients.sh | grep EMBER_BROWSER_VENV)"
    $EMBER_BROWSER_VENV/bin/python scripts/bench-browser.py --url http://127.0.0.1:7070 \
        --token "$(cat /var/lib/ember/token)" --n 10
"""

import argparse
import json
import os
import statistics
import time
import urllib.request

from playwright.sync_api import sync_playwright

PAGE = "data:text/html,<title>bench</title><body style='background:%23ff8800'><h1>first page</h1>"


def api(url, token, method, path, body=None):
    req = urllib.request.Request(url + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read() or b"null")


def vmm_memory(pid):
    """RSS and PSS (KiB) of the VMM process `pid` (SandboxInfo's `pid`), or None."""
    try:
        fields = {}
        for line in open(f"/proc/{pid}/smaps_rollup"):
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                fields[parts[0][:-1]] = int(parts[1])
        return {"rss_kib": fields.get("Rss"), "pss_kib": fields.get("Pss")}
    except (OSError, TypeError):
        return None


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:7070")
    ap.add_argument("--token", required=True)
    ap.add_argument("--template", default="browser")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds idle before reading memory")
    a = ap.parse_args()
    runs = []
    with sync_playwright() as p:
        for i in range(a.n):
            t0 = time.monotonic()
            sb = api(a.url, a.token, "POST", "/v1/sandboxes", {"template": a.template})
            t_create = time.monotonic()
            # Long time-outs: under kvm_pvm the first CDP calls after a restore take tens of s.
            browser = p.chromium.connect_over_cdp(f"{a.url}/v1/sandboxes/{sb['id']}/cdp",
                                                  headers={"Authorization": f"Bearer {a.token}"},
                                                  timeout=600_000)
            t_cdp = time.monotonic()
            page = browser.contexts[0].pages[0]
            page.goto(PAGE, timeout=600_000)
            assert page.title() == "bench"
            t_page = time.monotonic()
            # Not browser.close(): over CDP that ends the sandbox's Chromium; the idle figure is
            # of a sandbox whose browser still runs.
            time.sleep(a.idle)
            mem = vmm_memory(api(a.url, a.token, "GET", f"/v1/sandboxes/{sb['id']}").get("pid"))
            api(a.url, a.token, "DELETE", f"/v1/sandboxes/{sb['id']}")
            run = {"run": i, "create_s": t_create - t0, "cdp_connected_s": t_cdp - t0,
                   "first_page_s": t_page - t0, "start_ms": sb.get("start_ms"), "memory": mem}
            print(json.dumps(run), flush=True)
            runs.append(run)
    print("\nfigure                         median     p95   (N=%d)" % len(runs))
    for key in ("create_s", "cdp_connected_s", "first_page_s"):
        v = [r[key] for r in runs]
        print(f"create → {key[:-2]:<22} {statistics.median(v):7.3f}s {pct(v, 95):7.3f}s")
    rss = [r["memory"]["rss_kib"] / 1024 for r in runs if r["memory"]]
    pss = [r["memory"]["pss_kib"] / 1024 for r in runs if r["memory"]]
    if rss:
        print(f"idle VMM RSS                   {statistics.median(rss):7.1f} MiB {pct(rss, 95):7.1f} MiB")
        print(f"idle VMM PSS                   {statistics.median(pss):7.1f} MiB {pct(pss, 95):7.1f} MiB")


if __name__ == "__main__":
    main()

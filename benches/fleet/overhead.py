#!/usr/bin/env python3
"""What a gateway adds: the same calls, interleaved (ABAB), through a node's own API and
through a gateway in front of it, in one run on one host.

  overhead.py NODE_URL NODE_TOKEN_FILE GATEWAY_URL GATEWAY_TOKEN_FILE [ROUNDS]

Per round and target: create a `default` sandbox (POST /v1/sandboxes, answered once the
sandbox is ready), upload a 4 KiB file, then 5 × (`run_code` of `1`, read of the 4 KiB file),
then kill. Prints median and p95 per operation and target and the median difference.
docs/cluster.md shows how to start a node and a gateway; on one host both may listen on
loopback (the node's own API with `--listen`, its internal API with `--internal-listen`).
"""

import json
import statistics
import sys
import time
import urllib.request


def call(base, token, method, path, body=None, raw=False):
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = urllib.request.Request(
        base + path,
        data=data,
        method=method,
        headers={"authorization": "Bearer " + token, "content-type": "application/json"},
    )
    with urllib.request.urlopen(r, timeout=120) as resp:
        out = resp.read()
    return out if raw else out.decode()


def q(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p * (len(v) - 1))))]


def main(node_url, node_token, gw_url, gw_token, rounds):
    targets = {
        "node": (node_url, open(node_token).read().strip()),
        "gateway": (gw_url, open(gw_token).read().strip()),
    }
    res = {k: {"create": [], "run_code": [], "read4k": []} for k in targets}
    for i in range(rounds):
        order = ["node", "gateway"] if i % 2 == 0 else ["gateway", "node"]
        for name in order:
            base, tok = targets[name]
            t = time.perf_counter()
            sb = json.loads(call(base, tok, "POST", "/v1/sandboxes", {"template": "default"}))
            res[name]["create"].append((time.perf_counter() - t) * 1e3)
            sid = sb["id"]
            call(base, tok, "PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/f4k", b"x" * 4096)
            for _ in range(5):
                t = time.perf_counter()
                call(base, tok, "POST", f"/v1/sandboxes/{sid}/code", {"code": "1"})
                res[name]["run_code"].append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                b = call(base, tok, "GET", f"/v1/sandboxes/{sid}/files?path=/tmp/f4k", raw=True)
                res[name]["read4k"].append((time.perf_counter() - t) * 1e3)
                assert len(b) == 4096, len(b)
            call(base, tok, "DELETE", f"/v1/sandboxes/{sid}")
    for op in ["create", "run_code", "read4k"]:
        n, g = res["node"][op], res["gateway"][op]
        print(
            f"{op:9} node median {statistics.median(n):7.1f} p95 {q(n, .95):7.1f} ms | "
            f"gateway median {statistics.median(g):7.1f} p95 {q(g, .95):7.1f} ms | "
            f"added (median) {statistics.median(g) - statistics.median(n):+6.1f} ms  "
            f"(n={len(n)})"
        )


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    main(*sys.argv[1:5], int(sys.argv[5]) if len(sys.argv) == 6 else 10)

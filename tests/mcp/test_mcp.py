"""The official MCP Python SDK against ember: `ember mcp` over stdio and the server's /mcp over
streamable HTTP. Run by tests/mcp.rs with the venv of scripts/mcp-sdk.sh.

Environment: EMBER_BIN (the `ember` binary), EMBER_URL, EMBER_TOKEN (the running server's),
MCP_TEMPLATE_PLOT (a template with matplotlib), MCP_ROUNDS (round trips timed).

Prints one line per check, `ok NAME` or `FAIL NAME: why`, then `figure NAME {json}` lines,
and exits non-zero when a check failed.
"""

import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import httpx2
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

EMBER = os.environ["EMBER_BIN"]
URL = os.environ["EMBER_URL"].rstrip("/")
TOKEN = os.environ["EMBER_TOKEN"]
PLOT_TEMPLATE = os.environ.get("MCP_TEMPLATE_PLOT", "python-data")
ROUNDS = int(os.environ.get("MCP_ROUNDS", "10"))

TOOLS = {
    "create_sandbox", "run_code", "run_command", "read_file", "write_file", "list_files",
    "download_artifact", "browser_screenshot", "pause_sandbox", "resume_sandbox",
    "kill_sandbox", "list_sandboxes",
}

failed = []
figures = {}


def check(name, cond, why=""):
    if cond:
        print(f"ok {name}", flush=True)
    else:
        print(f"FAIL {name}: {why}", flush=True)
        failed.append(name)
    return cond


def dump(result):
    return result.model_dump(by_alias=True, exclude_none=True, mode="json")


def texts(result):
    return [c["text"] for c in dump(result).get("content", []) if c.get("type") == "text"]


async def call(s, name, **args):
    r = await s.call_tool(name, args)
    return r, dump(r)


def sandbox_id(d):
    sc = d.get("structuredContent") or {}
    if "sandbox_id" in sc:
        return sc["sandbox_id"]
    return json.loads(d["content"][0]["text"])["sandbox_id"]


async def common_checks(s, label, template):
    """List the tools, create a sandbox, keep state across run_code calls, files."""
    tools = await s.list_tools()
    names = {t.name for t in tools.tools}
    check(f"{label}:list_tools", TOOLS <= names, f"missing {TOOLS - names}")
    run = next((t for t in tools.tools if t.name == "run_code"), None)
    schema = run.input_schema if run is not None and hasattr(run, "input_schema") else run.inputSchema
    check(f"{label}:run_code_schema", "code" in schema.get("required", []), f"{schema}")

    r, d = await call(s, "create_sandbox", template=template, timeout_secs=120)
    if not check(f"{label}:create_sandbox", not d.get("isError"), f"{d}"):
        return None, names
    sid = sandbox_id(d)

    r, d = await call(s, "run_code", sandbox_id=sid, code="x = 6 * 7\nprint('set')")
    check(f"{label}:run_code_set", not d.get("isError") and "set" in "".join(texts(r)), f"{d}")
    r, d = await call(s, "run_code", sandbox_id=sid, code="x")
    check(f"{label}:run_code_state", "42" in texts(r), f"{d}")

    r, d = await call(s, "run_code", sandbox_id=sid, code="1/0")
    check(f"{label}:run_code_error",
          d.get("isError") is True and any("ZeroDivisionError" in t for t in texts(r)), f"{d}")

    r, d = await call(s, "write_file", sandbox_id=sid, path="/workspace/hello.txt",
                      content="hello from mcp\n")
    check(f"{label}:write_file", not d.get("isError"), f"{d}")
    r, d = await call(s, "read_file", sandbox_id=sid, path="/workspace/hello.txt")
    check(f"{label}:read_file", texts(r) == ["hello from mcp\n"], f"{d}")
    r, d = await call(s, "list_files", sandbox_id=sid, path="/workspace")
    check(f"{label}:list_files", any("/workspace/hello.txt" in t for t in texts(r)), f"{d}")
    r, d = await call(s, "run_command", sandbox_id=sid, command="echo out; echo err >&2; exit 3")
    t = "\n".join(texts(r))
    check(f"{label}:run_command", d.get("isError") is True and "out" in t and "err" in t
          and "status 3" in t, f"{d}")
    r, d = await call(s, "read_file", sandbox_id="0000000000000000", path="/etc/hostname")
    check(f"{label}:error_is_tool_error", d.get("isError") is True and texts(r), f"{d}")
    return sid, names


async def timed_run_code(s, sid):
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        r = await s.call_tool("run_code", {"sandbox_id": sid, "code": "1 + 1"})
        times.append((time.perf_counter() - t0) * 1e3)
        if "2" not in texts(r):
            raise RuntimeError(f"run_code 1 + 1 answered {dump(r)}")
    return times


def summary(times):
    return {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
            "n": len(times)}


async def http_part():
    # Without the token, and with a wrong one: 401 before any MCP.
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    # One connection each: the server answers 401 without reading the body, then closes.
    async with httpx2.AsyncClient() as c:
        r = await c.post(f"{URL}/mcp", json=init, headers=hdr)
        check("http:no_token_401", r.status_code == 401, f"{r.status_code} {r.text[:200]}")
    async with httpx2.AsyncClient() as c:
        r = await c.post(f"{URL}/mcp", json=init,
                         headers={**hdr, "Authorization": "Bearer wrong-token-0123456789"})
        check("http:wrong_token_401", r.status_code == 401, f"{r.status_code} {r.text[:200]}")

    client = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
    async with client:
        async with streamable_http_client(f"{URL}/mcp", http_client=client) as streams:
            read, write = streams[0], streams[1]
            async with ClientSession(read, write) as s:
                await s.initialize()
                sid, _ = await common_checks(s, "http", PLOT_TEMPLATE)
                if sid is None:
                    return None
                code = ("import matplotlib.pyplot as plt\n"
                        "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('mcp')\nplt.show()")
                r, d = await call(s, "run_code", sandbox_id=sid, code=code)
                imgs = [c for c in d.get("content", []) if c.get("type") == "image"]
                ok = bool(imgs) and imgs[0].get("mimeType") == "image/png" and \
                    base64.b64decode(imgs[0]["data"])[:8] == b"\x89PNG\r\n\x1a\n"
                check("http:matplotlib_image", ok,
                      f"{[{k: (v if k != 'data' else len(v)) for k, v in c.items()} for c in d.get('content', [])]}")
                # Artifacts: a file under /workspace/outputs, listed then read back.
                await call(s, "run_code", sandbox_id=sid, code=(
                    "import os; os.makedirs('/workspace/outputs', exist_ok=True)\n"
                    "open('/workspace/outputs/result.csv', 'w').write('a,b\\n1,2\\n')"))
                r, d = await call(s, "download_artifact", sandbox_id=sid)
                check("http:artifact_list", any("result.csv" in t for t in texts(r)), f"{d}")
                r, d = await call(s, "download_artifact", sandbox_id=sid, path="result.csv")
                check("http:artifact_read", texts(r) == ["a,b\n1,2\n"], f"{d}")
                figures["mcp_http_run_code"] = summary(await timed_run_code(s, sid))
                # The native API's own route, over one kept-alive connection (no process).
                times = []
                async with httpx2.AsyncClient(
                        headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                    for _ in range(ROUNDS):
                        t0 = time.perf_counter()
                        r = await c.post(f"{URL}/v1/sandboxes/{sid}/code", json={"code": "1 + 1"})
                        times.append((time.perf_counter() - t0) * 1e3)
                        if r.status_code != 200 or "2" not in r.text:
                            raise RuntimeError(f"native run_code: {r.status_code} {r.text}")
                figures["native_http_run_code"] = summary(times)
                r, d = await call(s, "kill_sandbox", sandbox_id=sid)
                check("http:kill_sandbox", not d.get("isError") and
                      d.get("structuredContent", {}).get("state") == "stopped", f"{d}")
                return sid


def native_state(sid):
    r = httpx2.get(f"{URL}/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {TOKEN}"})
    return r.json().get("state") if r.status_code == 200 else f"http {r.status_code}"


async def stdio_part():
    env = {"EMBER_URL": URL, "EMBER_TOKEN": TOKEN, "RUST_LOG": "info"}
    params = StdioServerParameters(command=EMBER, args=["mcp"], env=env)
    left = None
    with tempfile.NamedTemporaryFile("wb", suffix=".bin", delete=False) as f:
        payload = bytes(range(256)) * 64
        f.write(payload)
        local = f.name
    async with stdio_client(params) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as s:
            await s.initialize()
            sid, names = await common_checks(s, "stdio", "default")
            check("stdio:upload_file_listed", "upload_file" in names, f"{names}")
            if sid is None:
                return
            r, d = await call(s, "upload_file", sandbox_id=sid, local_path=local,
                              path="/workspace/up.bin")
            check("stdio:upload_file", not d.get("isError") and "16384" in "".join(texts(r)),
                  f"{d}")
            r, d = await call(s, "run_code", sandbox_id=sid, code=(
                "import hashlib; hashlib.sha256(open('/workspace/up.bin','rb').read())"
                ".hexdigest()"))
            import hashlib
            want = hashlib.sha256(payload).hexdigest()
            check("stdio:upload_file_content", any(want in t for t in texts(r)), f"{d}")
            r, d = await call(s, "upload_file", sandbox_id=sid, local_path="/nonexistent/x",
                              path="/workspace/x")
            check("stdio:upload_missing_is_tool_error", d.get("isError") is True, f"{d}")

            figures["mcp_stdio_run_code"] = summary(await timed_run_code(s, sid))
            # The native API, as a user would: one `ember code` process per call.
            times = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                out = subprocess.run([EMBER, "code", sid, "1 + 1"], capture_output=True,
                                     text=True, env={**os.environ, **env})
                times.append((time.perf_counter() - t0) * 1e3)
                if out.returncode != 0 or "2" not in out.stdout:
                    raise RuntimeError(f"ember code: {out.returncode} {out.stdout} {out.stderr}")
            figures["native_ember_code"] = summary(times)

            r, d = await call(s, "kill_sandbox", sandbox_id=sid)
            check("stdio:kill_sandbox", not d.get("isError"), f"{d}")
            # One left running: `ember mcp` must kill it when its stdin closes.
            r, d = await call(s, "create_sandbox", timeout_secs=300)
            if check("stdio:create_left_running", not d.get("isError"), f"{d}"):
                left = sandbox_id(d)
                check("stdio:left_running", native_state(left) == "running",
                      native_state(left))
    os.unlink(local)
    if left:
        t0 = time.monotonic()
        state = native_state(left)
        while state != "stopped" and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.2)
            state = native_state(left)
        check("stdio:killed_at_exit", state == "stopped", f"state {state}")
        figures["killed_at_exit_s"] = {"s": round(time.monotonic() - t0, 2)}


async def sigterm_part():
    """`ember mcp` stopped by SIGTERM kills what it created too (raw JSON-RPC lines: the
    SDK's stdio client does not hand out its process)."""
    import signal
    env = {**os.environ, "EMBER_URL": URL, "EMBER_TOKEN": TOKEN}
    p = subprocess.Popen([EMBER, "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=sys.stderr, env=env, text=True)

    def rpc(msg):
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()
        if "id" not in msg:
            return None
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("ember mcp closed its stdout")
            reply = json.loads(line)
            if reply.get("id") == msg["id"]:
                return reply

    rpc({"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                    "clientInfo": {"name": "sigterm", "version": "0"}}})
    rpc({"jsonrpc": "2.0", "method": "notifications/initialized"})
    r = rpc({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": "create_sandbox", "arguments": {"timeout_secs": 300}}})
    res = r.get("result", {})
    if not check("sigterm:create", not res.get("isError") and "structuredContent" in res, f"{r}"):
        p.kill()
        return
    sid = res["structuredContent"]["sandbox_id"]
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=20)
    check("sigterm:exit_status", code == 0, f"exit status {code}")
    state = native_state(sid)
    check("sigterm:killed_at_exit", state == "stopped", f"state {state}")


async def main():
    for part in (http_part, stdio_part, sigterm_part):
        t0 = time.perf_counter()
        try:
            await part()
        except Exception:
            traceback.print_exc()
            check(part.__name__, False, "raised (traceback above)")
        figures[f"{part.__name__}_s"] = {"s": round(time.perf_counter() - t0, 2)}
    for name, v in figures.items():
        print(f"figure {name} {json.dumps(v)}", flush=True)
    print(f"{len(failed)} failed: {failed}" if failed else "all passed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    asyncio.run(main())

#!/usr/bin/env python3
"""The official E2B Python SDKs (synchronous API) against `ember serve`.

Runs named checks in order and prints `ok <name> (<seconds>)` for each that passes, or
`FAIL <name>: <error>` with the traceback; a check whose prerequisite failed is reported as
`skip <name>`. Exits 1 if any check failed or was skipped, 0 otherwise. Every sandbox it made
is killed at the end, also on failure or SIGTERM.

Usage: test_sdk.py [--only NAME,NAME...] [--list]

Configuration is the SDKs' own environment (nothing here knows about ember):
  header route: E2B_API_KEY, E2B_API_URL=E2B_SANDBOX_URL=http://127.0.0.1:PORT
  TLS route:    E2B_API_KEY, E2B_DOMAIN=e2b.localhost:PORT, SSL_CERT_FILE=<bundle>
and NO_PROXY=127.0.0.1,localhost,.localhost when a proxy is configured.
Driven by tests/e2b.rs; installed by scripts/e2b-sdks.sh (tests/e2b/requirements.txt).
"""

import base64
import hashlib
import os
import signal
import sys
import time
import traceback
import uuid
from datetime import datetime, timezone

from e2b import (
    CommandExitException,
    InvalidArgumentException,
    TimeoutException,
    FileNotFoundException,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    SandboxException,
    SandboxQuery,
)
from e2b_code_interpreter import Sandbox

RUN_ID = uuid.uuid4().hex[:12]
CHECKS = []  # (name, function, prerequisites)
# Checks that run only when `--only` names them: `languages` needs a template with every
# context language (code-interpreter), which tests/languages.rs serves; tests/e2b.rs's server
# maps the SDK's default template to python-data.
ON_REQUEST = {"languages"}
CREATED = set()  # ids of every sandbox made here, killed at the end
STATE = {}  # what checks hand to later checks ("sbx", ...)


def check(*needs):
    def register(f):
        CHECKS.append((f.__name__, f, needs))
        return f

    return register


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def eq(got, want, what):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def made(sbx):
    CREATED.add(sbx.sandbox_id)
    return sbx


def sbx():
    return STATE["sbx"]


def timed(f, *a, **kw):
    t = time.monotonic()
    r = f(*a, **kw)
    return r, time.monotonic() - t


def note(msg):
    print(f"   {msg}", flush=True)


# ------------------------------------------------------------------------- lifecycle


@check()
def create():
    s, dt = timed(
        Sandbox.create,
        envs={"FOO": "bar-from-create"},
        metadata={"suite": RUN_ID, "role": "main"},
        # The suite's shared sandbox lives through every check (a slow kvm_pvm host once took
        # over 600 s to reach the large files check, which the sandbox's end then cut off);
        # every call on it gets 300 s instead of the SDK's 60 s (`commands.run` took 41 s).
        timeout=1800,
        request_timeout=300,
    )
    made(s)
    expect(s.sandbox_id, "no sandbox id")
    note(f"Sandbox.create() (template code-interpreter-v1) {s.sandbox_id} in {dt:.2f} s")
    STATE["sbx"] = s


@check("create")
def run_code_state():
    r = sbx().run_code("x = 1")
    expect(r.error is None, f"x = 1 failed: {r.error}")
    r, dt = timed(sbx().run_code, "x + 1")
    eq(r.text, "2", "run_code('x + 1').text")
    note(f"run_code round trip {dt * 1000:.0f} ms")


@check("create")
def run_code_in_home():
    # E2B code runs in the user's home, where relative file paths land.
    r = sbx().run_code("import os; os.getcwd()")
    eq(r.text, "/home/user", "run_code cwd")
    sbx().files.write("from_sdk.txt", "written by files.write")
    r = sbx().run_code("open('from_sdk.txt').read()")
    eq(r.text, "written by files.write", "a relative file from files.write, read by code")
    r = sbx().run_code("pwd", language="bash")
    eq("".join(r.logs.stdout).strip(), "/home/user", "bash cwd")


@check("create")
def code_contexts():
    s = sbx()
    ctx = s.create_code_context(cwd="/tmp")
    eq(ctx.cwd, "/tmp", "context cwd")
    s.run_code("y = 5", context=ctx)
    eq(s.run_code("y * 2", context=ctx).text, "10", "state kept in a context")
    eq(s.run_code("import os; os.getcwd()", context=ctx).text, "/tmp", "cwd in the context")
    expect(ctx.id in [c.id for c in s.list_code_contexts()], "the context is listed")
    s.restart_code_context(ctx)
    eq(s.run_code("'y' in globals()", context=ctx).text, "False", "a restart drops state")
    s.remove_code_context(ctx)
    expect(ctx.id not in [c.id for c in s.list_code_contexts()], "a removed context is gone")
    try:
        s.run_code("1", context=ctx)
        raise AssertionError("run_code in a removed context succeeded")
    except NotFoundException:
        pass


@check("create")
def metrics():
    m = sbx().get_metrics()
    expect(len(m) >= 1, "get_metrics() returned no sample")
    last = m[-1]
    expect(last.cpu_count >= 1 and last.mem_total > 0 and last.mem_used > 0, f"sample {last}")


@check("create")
def pty():
    h = sbx().pty.create(PtySize(rows=30, cols=100), user="root")
    sbx().pty.send_stdin(h.pid, b"stty size; exit 0\n")
    out = bytearray()
    h.wait(on_pty=lambda d: out.extend(d))
    expect(b"30 100" in out, f"stty size on the terminal: {bytes(out)!r}")


@check("create")
def run_code_stdout():
    r = sbx().run_code("print('hello'); import sys; print('oops', file=sys.stderr)")
    eq("".join(r.logs.stdout), "hello\n", "stdout")
    eq("".join(r.logs.stderr), "oops\n", "stderr")


@check("create")
def run_code_plot():
    r = sbx().run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('ember')\n"
        "plt.show()"
    )
    expect(r.error is None, f"plot failed: {r.error}")
    pngs = [x.png for x in r.results if x.png]
    expect(pngs, f"no result with .png among {r.results!r}")
    data = base64.b64decode(pngs[0])
    expect(data.startswith(b"\x89PNG\r\n\x1a\n"), "the .png is not a PNG")
    note(f"plot: {len(data)} bytes of PNG")


@check("create")
def run_code_error():
    r = sbx().run_code("1 / 0")
    expect(r.error is not None, "no error for 1 / 0")
    eq(r.error.name, "ZeroDivisionError", "error.name")
    expect("division by zero" in r.error.value, f"error.value {r.error.value!r}")
    expect(r.error.traceback, "empty traceback")


@check("create")
def envs_from_create():
    r = sbx().commands.run("echo $FOO")
    eq(r.stdout.strip(), "bar-from-create", "commands.run('echo $FOO')")
    r = sbx().run_code("import os; os.environ['FOO']")
    eq(r.text, "bar-from-create", "run_code os.environ['FOO']")


@check("create")
def run_code_envs():
    r = sbx().run_code("import os; os.environ['PER_CALL']", envs={"PER_CALL": "v1"})
    eq(r.text, "v1", "run_code(envs=) os.environ['PER_CALL']")
    r = sbx().run_code("import os; 'PER_CALL' in os.environ")
    eq(r.text, "False", "PER_CALL after the call that set it")


# -------------------------------------------------------------------------- commands


@check("create")
def commands_run():
    r = sbx().commands.run("echo out; echo err >&2")
    eq(r.stdout, "out\n", "stdout")
    eq(r.stderr, "err\n", "stderr")
    eq(r.exit_code, 0, "exit_code")


@check("create")
def commands_exit_code():
    try:
        sbx().commands.run("echo bad >&2; exit 3")
    except CommandExitException as e:
        eq(e.exit_code, 3, "exit_code")
        eq(e.stderr, "bad\n", "stderr")
    else:
        raise AssertionError("no CommandExitException for exit 3")


@check("create")
def commands_envs_cwd():
    r = sbx().commands.run("echo $A; pwd", envs={"A": "b"}, cwd="/tmp")
    eq(r.stdout, "b\n/tmp\n", "stdout")


@check("create")
def commands_background():
    h = sbx().commands.run("sleep 30", background=True)
    pid = h.pid
    expect(pid, "no pid")
    pids = [p.pid for p in sbx().commands.list()]
    expect(pid in pids, f"pid {pid} not in commands.list() {pids}")
    h2 = sbx().commands.connect(pid)
    eq(h2.pid, pid, "connect(pid).pid")
    eq(sbx().commands.kill(pid), True, "commands.kill(pid)")
    try:
        r = h2.wait()
        raise AssertionError(f"a killed command ended normally: {r!r}")
    except CommandExitException as e:
        expect(e.exit_code != 0, f"exit_code {e.exit_code}")
    eq(sbx().commands.kill(pid), False, "commands.kill of a finished pid")


@check("create")
def commands_stdin():
    h = sbx().commands.run("head -n 1", background=True, stdin=True)
    sbx().commands.send_stdin(h.pid, "hello stdin\n")
    eq(h.wait().stdout, "hello stdin\n", "head -n 1 stdout")
    h = sbx().commands.run("cat", background=True, stdin=True)
    sbx().commands.send_stdin(h.pid, "a")
    sbx().commands.send_stdin(h.pid, b"b\n")
    sbx().commands.close_stdin(h.pid)
    eq(h.wait().stdout, "ab\n", "cat stdout after close_stdin")


# ----------------------------------------------------------------------------- files

D = "/home/user/e2b-test"


@check("create")
def files_basic():
    f = sbx().files
    w = f.write(f"{D}/a.txt", "alpha")
    eq(w.path, f"{D}/a.txt", "WriteInfo.path")
    eq(f.read(f"{D}/a.txt"), "alpha", "read")
    eq(bytes(f.read(f"{D}/a.txt", format="bytes")), b"alpha", "read bytes")
    eq(f.exists(f"{D}/a.txt"), True, "exists")
    eq(f.exists(f"{D}/missing"), False, "exists(missing)")
    eq(f.make_dir(f"{D}/sub"), True, "make_dir")
    eq(f.make_dir(f"{D}/sub"), False, "make_dir again")
    entries = {e.name: e for e in f.list(D)}
    expect({"a.txt", "sub"} <= set(entries), f"list: {sorted(entries)}")
    eq(entries["a.txt"].type.value, "file", "a.txt type")
    eq(entries["sub"].type.value, "dir", "sub type")
    eq(entries["a.txt"].size, 5, "a.txt size")
    eq(entries["a.txt"].path, f"{D}/a.txt", "a.txt path")
    info = f.rename(f"{D}/a.txt", f"{D}/b.txt")
    eq(info.path, f"{D}/b.txt", "rename result path")
    eq(f.exists(f"{D}/a.txt"), False, "exists after rename")
    eq(f.read(f"{D}/b.txt"), "alpha", "read after rename")
    f.remove(f"{D}/b.txt")
    eq(f.exists(f"{D}/b.txt"), False, "exists after remove")
    try:
        f.read(f"{D}/b.txt")
        raise AssertionError("read of a removed file succeeded")
    except FileNotFoundException:
        pass
    # Relative paths are the user's home; binary data and a file-like upload
    # (application/octet-stream) go through unchanged.
    f.write("rel.txt", b"\x00\x01\xff")
    eq(bytes(f.read("/home/user/rel.txt", format="bytes")), b"\x00\x01\xff", "relative write")
    import io

    f.write(f"{D}/stream.bin", io.BytesIO(b"x" * 100_000))
    eq(len(f.read(f"{D}/stream.bin", format="bytes")), 100_000, "file-like upload")
    eq(
        sbx().commands.run(f"cat {D}/sub/../../rel.txt | od -An -tx1").stdout.split(),
        ["00", "01", "ff"],
        "the guest sees the bytes",
    )


@check("create")
def files_watch_dir():
    f = sbx().files
    f.make_dir(f"{D}/watched")
    h = f.watch_dir(f"{D}/watched")
    try:
        f.write(f"{D}/watched/w.txt", "w")
        seen = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            seen += h.get_new_events()
            if any(e.name == "w.txt" for e in seen):
                break
            time.sleep(0.2)
        hits = [e for e in seen if e.name == "w.txt"]
        expect(hits, f"no event for w.txt in 15 s (events: {seen})")
        types = {e.type for e in hits}
        expect(
            types & {FilesystemEventType.CREATE, FilesystemEventType.WRITE},
            f"event types {types}",
        )
    finally:
        h.stop()


@check("create")
def files_large():
    # 16 chunks of the SDK's stream each way; the native suite (tests/files_exec.rs) moves a
    # bigger file and bounds the memory streaming takes.
    size = 16 << 20
    data = os.urandom(size)
    want = hashlib.sha256(data).hexdigest()
    path = f"{D}/large.bin"
    # The SDK's default 60 s request timeout is a whole-request deadline: this check is about
    # the bytes arriving intact; the rates are printed.
    _, up = timed(sbx().files.write, path, data, request_timeout=600)
    back, down = timed(sbx().files.read, path, format="bytes", request_timeout=600)
    eq(len(back), size, "downloaded size")
    eq(hashlib.sha256(back).hexdigest(), want, "sha256 of the download")
    guest = sbx().commands.run(f"sha256sum {path}").stdout.split()[0]
    eq(guest, want, "sha256 in the guest")
    mib = size >> 20
    note(
        f"{mib} MiB upload {up:.2f} s ({mib / up:.2f} MiB/s), "
        f"download {down:.2f} s ({mib / down:.2f} MiB/s)"
    )
    sbx().files.remove(path)


# ----------------------------------------------------------------- sandbox API calls


@check("create")
def set_timeout_get_info():
    sbx().set_timeout(900)
    info = sbx().get_info()
    eq(info.sandbox_id, sbx().sandbox_id, "get_info().sandbox_id")
    eq(info.metadata.get("suite"), RUN_ID, "metadata")
    eq(str(getattr(info.state, "value", info.state)), "running", "state")
    left = (info.end_at - datetime.now(timezone.utc)).total_seconds()
    expect(800 < left <= 905, f"end_at is {left:.0f} s away after set_timeout(900)")
    sbx().set_timeout(600)


@check("create")
def list_with_metadata():
    page = Sandbox.list(query=SandboxQuery(metadata={"suite": RUN_ID})).next_items()
    ids = [s.sandbox_id for s in page]
    expect(sbx().sandbox_id in ids, f"{sbx().sandbox_id} not listed: {ids}")
    expect(all(s.metadata.get("suite") == RUN_ID for s in page), "a listed sandbox lacks the metadata")
    other = Sandbox.list(query=SandboxQuery(metadata={"suite": "no-" + RUN_ID})).next_items()
    expect(sbx().sandbox_id not in [s.sandbox_id for s in other], "listed under other metadata")


@check("create")
def connect():
    other = Sandbox.connect(sbx().sandbox_id)
    eq(other.sandbox_id, sbx().sandbox_id, "sandbox_id")
    eq(other.run_code("x").text, "1", "run_code('x') through the connected handle")
    eq(other.files.exists("/home/user/rel.txt"), True, "file through the connected handle")


@check("create")
def pause_resume():
    s = sbx()
    s.run_code("y = 42")
    s.files.write(f"{D}/kept.txt", "kept")
    ok, dt = timed(s.pause)
    eq(ok, True, "pause()")
    note(f"pause {dt:.2f} s")
    eq(str(getattr(Sandbox.get_info(s.sandbox_id).state, "value", "?")), "paused", "state")
    eq(Sandbox.pause(s.sandbox_id), False, "pause of a paused sandbox")
    resumed, dt = timed(Sandbox.connect, s.sandbox_id)
    note(f"resume (Sandbox.connect) {dt:.2f} s")
    eq(resumed.run_code("x + y").text, "43", "interpreter state after resume")
    eq(resumed.files.read(f"{D}/kept.txt"), "kept", "file after resume")
    eq(resumed.commands.run("echo $FOO").stdout.strip(), "bar-from-create", "envs after resume")
    STATE["sbx"] = resumed


@check("create")
def fork():
    s = sbx()
    s.run_code("z = 'source'")
    s.files.write(f"{D}/fork-src.txt", "from source")
    forks, dt = timed(s.fork, count=3)
    eq(len(forks), 3, "number of forks")
    bad = [f for f in forks if isinstance(f, Exception)]
    for f in forks:
        if not isinstance(f, Exception):
            made(f)
    expect(not bad, f"forks failed: {bad}")
    note(f"fork(count=3) {dt:.2f} s: {[f.sandbox_id for f in forks]}")
    ids = {f.sandbox_id for f in forks} | {s.sandbox_id}
    eq(len(ids), 4, "distinct sandbox ids")
    for i, f in enumerate(forks):
        eq(f.run_code("z").text, "source", f"fork {i}: variable z")
        eq(f.files.read(f"{D}/fork-src.txt"), "from source", f"fork {i}: file")
        f.run_code(f"z = 'fork{i}'")
        f.files.write(f"{D}/fork{i}.txt", f"fork {i}")
    for i, f in enumerate(forks):
        eq(f.run_code("z").text, f"fork{i}", f"fork {i}: its own z")
        others = [j for j in range(3) if j != i and f.files.exists(f"{D}/fork{j}.txt")]
        expect(not others, f"fork {i} sees the files of forks {others}")
    eq(s.run_code("z").text, "source", "the source's z after the forks wrote theirs")
    expect(not s.files.exists(f"{D}/fork0.txt"), "the source sees a fork's file")
    eq(s.run_code("x").text, "1", "the source still runs")
    for f in forks:
        eq(f.kill(), True, f"kill fork {f.sandbox_id}")


@check("create")
def snapshot():
    s = sbx()
    s.run_code("w = 'snap'")
    s.files.write(f"{D}/snap.txt", "in snapshot")
    info, dt = timed(s.create_snapshot)
    expect(info.snapshot_id, "no snapshot_id")
    note(f"create_snapshot {dt:.2f} s: {info.snapshot_id}")
    eq(s.run_code("w").text, "snap", "the source runs after the snapshot")
    s.files.write(f"{D}/snap.txt", "changed after")
    t, dt = timed(Sandbox.create, info.snapshot_id)
    made(t)
    note(f"Sandbox.create(snapshot_id) {dt:.2f} s: {t.sandbox_id}")
    eq(t.run_code("w").text, "snap", "variable in the sandbox made from the snapshot")
    eq(t.files.read(f"{D}/snap.txt"), "in snapshot", "file in the sandbox made from the snapshot")
    eq(t.kill(), True, "kill")


@check("create")
def filesystem_snapshot_and_reboot():
    # On `base` (ember's `default`): a reboot runs the template's warm-up again, which on the
    # data templates is minutes of imports under kvm_pvm; what is checked here is the same.
    s = made(Sandbox.create("base", timeout=600))
    s.run_code("v = 'in memory'")
    s.files.write(f"{D}/on-disk.txt", "on disk")
    info, dt = timed(s.create_snapshot, mode="filesystem")
    expect(info.snapshot_id, "no snapshot_id")
    note(f"create_snapshot(mode='filesystem') {dt:.2f} s")
    eq(s.run_code("v").text, "in memory", "the source runs after the snapshot")
    # A pause keeps the memory; a reboot keeps what reached the disk: flush it first.
    eq(s.commands.run("sync").exit_code, 0, "sync")
    eq(s.pause(), True, "pause()")
    # A cold boot plus the template's warm-up: tens of seconds on kvm_pvm.
    r, dt = timed(Sandbox.connect, s.sandbox_id, on_resume="reboot", request_timeout=600)
    note(f"connect(on_resume='reboot') {dt:.2f} s")
    eq(r.files.read(f"{D}/on-disk.txt"), "on disk", "file after a reboot")
    err = r.run_code("v").error
    eq(err.name if err else None, "NameError", "memory state after a reboot")
    eq(r.run_code("1 + 1").text, "2", "run_code after a reboot")
    eq(r.kill(), True, "kill")


# One sandbox of the template (code-interpreter-v1 = ember's code-interpreter), per language:
# state across three cells, a rich result, stdout streamed before the end, an error with its
# name, a timeout that interrupts and keeps the state, two contexts isolated from each other.
LANGUAGE_CELLS = {
    "javascript": {
        "state": ["const base = 40", "function add(x) { return base + x }",
                  "console.log('sum', add(2)); ({ sum: add(2), list: [1, 2] })"],
        "text": "{ sum: 42, list: [ 1, 2 ] }",
        "stream": "console.log('first'); await new Promise(r => setTimeout(r, 1500)); 'later'",
        "error": ("null.x", "TypeError"),
        "spin": "while (true) require('fs').fstatSync(1)",
        "probe": ("add(1)", "41"),
        "absent": ("typeof base === 'undefined'", "true"),
    },
    "typescript": {
        "state": ["const base: number = 40", "interface P { v: number }",
                  "const p: P = { v: base + 2 }; console.log('sum', p.v); p"],
        "text": "{ v: 42 }",
        "stream": "console.log('first'); await new Promise<void>(r => setTimeout(r, 1500)); 'later'",
        "error": ("let x: = 1", "SyntaxError"),
        "spin": "while (true) require('fs').fstatSync(1)",
        "probe": ("base + 1", "41"),
        "absent": ("typeof base === 'undefined'", "true"),
    },
    "r": {
        "state": ["base <- 40", "add <- function(x) base + x",
                  "cat('sum', add(2), '\\n'); data.frame(a = 1:2, b = c('u', 'v'))"],
        "html": "<table",
        "stream": "cat('first\\n'); Sys.sleep(1.5); 'later'",
        "error": ("stop('bad')", "simpleError"),
        "spin": "repeat Sys.getpid()",
        "probe": ("add(1)", "[1] 41"),
        "absent": ("exists('base')", "[1] FALSE"),
    },
    "java": {
        "state": ["int base = 40;", "int add(int x) { return base + x; }",
                  "System.out.println(\"sum \" + add(2)); add(2)"],
        "text": "42",
        "stream": "System.out.println(\"first\"); Thread.sleep(1500); \"later\"",
        "error": ("Integer.parseInt(\"zz\")", "java.lang.NumberFormatException"),
        "spin": "while (true) { new java.io.File(\"/\").exists(); }",
        "probe": ("add(1)", "41"),
        "absent": ("base", None),
    },
}


@check("create")
def languages():
    s = sbx()
    # A cell may take a minute on a loaded kvm_pvm host (a JVM's third cell took 63 s beside
    # the other SDK's checks): 600 s each.
    t = 600
    for lang, c in LANGUAGE_CELLS.items():
        for code in c["state"][:-1]:
            r = s.run_code(code, language=lang, timeout=t)
            expect(r.error is None, f"{lang}: {code!r}: {r.error}")
        r, dt = timed(s.run_code, c["state"][-1], language=lang, timeout=t)
        expect(r.error is None, f"{lang}: third cell: {r.error}")
        eq("".join(r.logs.stdout).strip(), "sum 42", f"{lang}: stdout of the third cell")
        if "text" in c:
            eq(r.text, c["text"], f"{lang}: the result's text")
        if "html" in c:
            html = [x.html for x in r.results if x.html]
            expect(html and c["html"] in html[0], f"{lang}: no HTML table among {r.results!r}")
        note(f"{lang}: third cell {dt * 1000:.0f} ms")
        seen = []
        t0 = time.monotonic()
        r = s.run_code(c["stream"], language=lang, timeout=t,
                       on_stdout=lambda m: seen.append(time.monotonic() - t0))
        took = time.monotonic() - t0
        expect(seen and took - seen[0] > 0.8, f"{lang}: stdout not streamed: at {seen}, end at {took:.2f}")
        code, name = c["error"]
        r = s.run_code(code, language=lang, timeout=t)
        expect(r.error is not None, f"{lang}: no error for {code!r}")
        eq(r.error.name, name, f"{lang}: error.name")
        # Known bug (docs/e2b.md): an interrupt that lands while Node.js still transpiles or
        # compiles the cell is lost; javascript and typescript give up later, after that work.
        give_up = 10 if lang in ("javascript", "typescript") else 3
        try:
            s.run_code(c["spin"], language=lang, timeout=give_up)
            raise AssertionError(f"{lang}: an endless loop ended")
        except TimeoutException:
            pass
        # The client's timeout cancelled the run (the server closed its agent connection):
        # that cell was interrupted, the context and its state kept, and the next cell runs.
        code, text = c["probe"]
        r = s.run_code(code, language=lang, timeout=t)
        expect(r.error is None, f"{lang}: after the timeout: {r.error}")
        eq(r.text, text, f"{lang}: the state after the timeout")
        ctx, dt = timed(s.create_code_context, language=lang)
        note(f"{lang}: create_code_context {dt * 1000:.0f} ms")
        code, want = c["absent"]
        r = s.run_code(code, context=ctx, timeout=t)
        if want is None:
            expect(r.error is not None, f"{lang}: {code!r} in a new context did not fail")
        else:
            eq(r.text, want, f"{lang}: a new context does not see the default one's state")
    try:
        s.run_code("1", language="cobol")
        raise AssertionError("run_code(language='cobol') succeeded")
    except (InvalidArgumentException, SandboxException) as e:
        expect("javascript" in str(e), f"the refusal lists the languages: {e}")


@check("create")
def kill():
    s = sbx()
    eq(s.kill(), True, "kill()")
    eq(Sandbox.kill(s.sandbox_id), False, "Sandbox.kill of a killed sandbox")
    eq(Sandbox.kill("i" + uuid.uuid4().hex[:19]), False, "Sandbox.kill(unknown id)")
    try:
        Sandbox.get_info(s.sandbox_id)
        raise AssertionError("get_info of a killed sandbox succeeded")
    except NotFoundException:
        pass
    eq(s.is_running(), False, "is_running() after kill")
    CREATED.discard(s.sandbox_id)


# ------------------------------------------------------------------------------ main


def cleanup():
    for sid in sorted(CREATED):
        try:
            Sandbox.kill(sid, request_timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort
            print(f"   cleanup: kill {sid}: {e}", flush=True)
    CREATED.clear()


def main(argv):
    names = [n for n, _, _ in CHECKS]
    only = None
    if "--list" in argv:
        print("\n".join(names))
        return 0
    if "--only" in argv:
        only = argv[argv.index("--only") + 1].split(",")
        unknown = [n for n in only if n not in names]
        if unknown:
            print(f"unknown checks {unknown}; known: {names}", file=sys.stderr)
            return 2
    route = os.environ.get("E2B_SANDBOX_URL") or f"https://*.{os.environ.get('E2B_DOMAIN', 'e2b.app')}"
    print(f"e2b Python SDK checks, run {RUN_ID}, sandbox route {route}", flush=True)

    def on_term(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
    passed, failed, skipped = [], [], []
    try:
        for name, f, needs in CHECKS:
            if only is not None and name not in only and name != "create":
                continue
            if only is None and name in ON_REQUEST:
                continue
            missing = [n for n in needs if n not in passed]
            if missing:
                print(f"skip {name}: needs {', '.join(missing)}", flush=True)
                skipped.append(name)
                continue
            t = time.monotonic()
            try:
                f()
            except Exception as e:  # noqa: BLE001 - report every check
                print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(file=sys.stdout)
                failed.append(name)
                continue
            print(f"ok {name} ({time.monotonic() - t:.2f} s)", flush=True)
            passed.append(name)
    finally:
        cleanup()
    print(
        f"{len(passed)} passed, {len(failed)} failed ({', '.join(failed) or '-'}), "
        f"{len(skipped)} skipped",
        flush=True,
    )
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

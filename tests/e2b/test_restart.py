#!/usr/bin/env python3
"""A background process started through the E2B Python SDK keeps its tag across a restart of
`ember serve`, and the SDK re-attaches to it; a directory watcher created before the restart
still delivers events after it (tests/e2b.rs drives the two phases around the restart;
configuration is the SDK's own environment, as for test_sdk.py).

  test_restart.py start        creates a sandbox, starts a tagged ticking process through
                               envd's process.Start, checks commands.list(), creates a
                               watcher on a directory (files.watch_dir) and sees it work;
                               prints `sandbox <id> pid <pid> watcher <watcher id>`
  test_restart.py after ID PID WATCHER
                               connects to the sandbox again, checks commands.list() still
                               shows the tag and the command, re-attaches with
                               commands.connect(pid) and reads new output, then writes a file
                               in the watched directory and polls the watcher made before
                               the restart (the SDK's own WatchHandle, given its id) until it
                               reports it; prints `ok`

The SDK's commands.run() has no tag parameter (envd's tag is for a template's start
command), so `start` sends process.Start with a tag through the SDK's own RPC client, as the
SDK does for run().
"""

import sys
import time

from e2b import Sandbox
from e2b.connection_config import KEEPALIVE_PING_HEADER, KEEPALIVE_PING_INTERVAL_SEC
from e2b.envd.client_sync import as_stream
from e2b.envd.process import process_pb
from e2b.envd.utils import authentication_header
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from e2b.sandbox_sync.filesystem.watch_handle import WatchHandle

TAG = "ticker-restart"
WATCHED = "/home/user/watched"
SCRIPT = "i=0; while true; do i=$((i+1)); echo tick $i; sleep 1; done"


def listed(sbx, pid):
    for p in sbx.commands.list():
        if p.pid == pid:
            return p
    raise AssertionError(f"pid {pid} not in commands.list(): {sbx.commands.list()!r}")


def check_listed(sbx, pid):
    p = listed(sbx, pid)
    if p.tag != TAG:
        raise AssertionError(f"tag of pid {pid}: got {p.tag!r}, want {TAG!r}")
    if p.cmd != "/bin/sh" or p.args != ["-c", SCRIPT]:
        raise AssertionError(f"config of pid {pid}: got {p.cmd!r} {p.args!r}")


def start():
    sbx = Sandbox.create(timeout=600)
    c = sbx.commands
    events = as_stream(
        c._rpc.start(
            process_pb.StartRequest(
                process=process_pb.ProcessConfig(
                    cmd="/bin/sh", envs={}, args=["-c", SCRIPT], cwd="/tmp"
                ),
                stdin=False,
                tag=TAG,
            ),
            headers={
                **authentication_header(c._envd_version, None),
                KEEPALIVE_PING_HEADER: str(KEEPALIVE_PING_INTERVAL_SEC),
            },
            timeout_ms=0,
        )
    )
    handle = c._create_handle(events, "start process", True)
    pid = handle.pid
    handle.disconnect()
    check_listed(sbx, pid)
    sbx.files.make_dir(WATCHED)
    watcher = sbx.files.watch_dir(WATCHED)
    sbx.files.write(f"{WATCHED}/before.txt", "before the restart")
    wait_for(watcher, "before.txt")
    print(f"sandbox {sbx.sandbox_id} pid {pid} watcher {watcher._watcher_id}", flush=True)


def wait_for(watcher, name):
    """Polls `watcher` until it reports a create or write of `name` (10 s at most)."""
    seen = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        for ev in watcher.get_new_events():
            seen.append((ev.name, ev.type))
            if ev.name == name and ev.type in (
                FilesystemEventType.CREATE,
                FilesystemEventType.WRITE,
            ):
                return seen
        time.sleep(0.2)
    raise AssertionError(f"the watcher did not report {name} in 10 s: saw {seen!r}")


def after(sandbox_id, pid, watcher_id):
    sbx = Sandbox.connect(sandbox_id)
    check_listed(sbx, pid)
    seen = []
    handle = sbx.commands.connect(pid, timeout=30)
    t0 = time.monotonic()
    for stdout, _stderr, _pty in handle:
        if stdout:
            seen += [line for line in stdout.split("\n") if line.startswith("tick ")]
        if len(seen) >= 2 or time.monotonic() - t0 > 20:
            break
    handle.disconnect()
    if len(seen) < 2:
        raise AssertionError(f"re-attached to pid {pid} but read {seen!r} in 20 s")
    files = sbx.files
    watcher = WatchHandle(
        files._rpc, watcher_id, files._connection_config, files._envd_version
    )
    sbx.files.write(f"{WATCHED}/after.txt", "after the restart")
    events = wait_for(watcher, "after.txt")
    watcher.stop()
    sbx.kill()
    print(f"ok re-attached to {TAG} (pid {pid}): {seen[:2]}; watcher {watcher_id}: {events}",
          flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["start"]:
        start()
    elif sys.argv[1:2] == ["after"] and len(sys.argv) == 5:
        after(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(__doc__)

#!/usr/bin/env python3
"""A background process started through the E2B Python SDK keeps its tag across a restart of
`ember serve`, and the SDK re-attaches to it (tests/e2b.rs drives the two phases around the
restart; configuration is the SDK's own environment, as for test_sdk.py).

  test_restart.py start        creates a sandbox, starts a tagged ticking process through
                               envd's process.Start, checks commands.list(); prints
                               `sandbox <id> pid <pid>`
  test_restart.py after ID PID connects to the sandbox again, checks commands.list() still
                               shows the tag and the command, re-attaches with
                               commands.connect(pid) and reads new output; prints `ok`

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

TAG = "ticker-restart"
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
    print(f"sandbox {sbx.sandbox_id} pid {pid}", flush=True)


def after(sandbox_id, pid):
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
    sbx.kill()
    print(f"ok re-attached to {TAG} (pid {pid}): {seen[:2]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["start"]:
        start()
    elif sys.argv[1:2] == ["after"] and len(sys.argv) == 4:
        after(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)

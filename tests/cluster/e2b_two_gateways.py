#!/usr/bin/env python3
"""The E2B Python SDK, unchanged, against a fleet: a sandbox made and used through one
gateway, then connected to and used through another (tests/cluster.rs runs this).

  e2b_two_gateways.py GATEWAY1_URL GATEWAY2_URL     (E2B_API_KEY: the gateways' token)

Through gateway 1: Sandbox.create, run_code (state kept), files.write, commands.run, a
background command. Through gateway 2: Sandbox.connect to the same id, the interpreter's
state and the file are there, commands.list shows the background command, pause. Through
gateway 1 again: Sandbox.connect resumes it with its state, kill. Prints `ok`.
"""

import os
import sys

from e2b_code_interpreter import Sandbox


def through(url):
    os.environ["E2B_API_URL"] = url
    os.environ["E2B_SANDBOX_URL"] = url


def main(gw1, gw2):
    through(gw1)
    sbx = Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    r = sbx.run_code("fleet = 6 * 7; fleet")
    if r.text != "42":
        raise AssertionError(f"run_code through gateway 1: {r!r}")
    sbx.files.write("/home/user/fleet.txt", "written through gateway 1")
    out = sbx.commands.run("cat /home/user/fleet.txt").stdout
    if out != "written through gateway 1":
        raise AssertionError(f"commands.run through gateway 1: {out!r}")
    bg = sbx.commands.run("sleep 120", background=True)

    through(gw2)
    again = Sandbox.connect(sid)
    r = again.run_code("fleet + 1")
    if r.text != "43":
        raise AssertionError(f"state through gateway 2: {r!r}")
    text = again.files.read("/home/user/fleet.txt")
    if text != "written through gateway 1":
        raise AssertionError(f"files.read through gateway 2: {text!r}")
    pids = [p.pid for p in again.commands.list()]
    if bg.pid not in pids:
        raise AssertionError(f"background pid {bg.pid} not listed through gateway 2: {pids}")
    again.commands.kill(bg.pid)
    # Paused through gateway 2, resumed (Sandbox.connect) through gateway 1, state kept.
    if again.pause() is not True:
        raise AssertionError("pause through gateway 2")
    through(gw1)
    if str(getattr(Sandbox.get_info(sid).state, "value", "?")) != "paused":
        raise AssertionError(f"state through gateway 1: {Sandbox.get_info(sid)!r}")
    back = Sandbox.connect(sid)
    r = back.run_code("fleet + 2")
    if r.text != "44":
        raise AssertionError(f"state after pause and connect: {r!r}")
    back.kill()
    print(f"ok: sandbox {sid} made through {gw1}, used through {gw2}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

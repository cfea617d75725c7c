#!/usr/bin/env python3
"""The test binaries of a `cargo test --no-run --message-format=json` build, one per line.

Reads cargo's JSON messages on stdin and prints, for each test executable it built, a line of
four tab-separated fields:

    name    label    directory    executable

`name` is the target's name (`e2b`, `ember_agent`), `label` what cargo's own `Running` line
says of it (`unittests src/lib.rs` or `tests/e2b.rs`), `directory` the package's directory
(cargo runs a test binary there) and `executable` its path. scripts/test.sh runs the binaries
itself, in two lanes, from this list.
"""

import json
import os
import sys


def binaries(lines):
    seen = set()
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        exe = msg["executable"]
        if exe in seen:
            continue
        seen.add(exe)
        pkg_dir = os.path.dirname(msg["manifest_path"])
        src = os.path.relpath(target["src_path"], pkg_dir)
        kinds = target.get("kind", [])
        label = src if "test" in kinds else f"unittests {src}"
        yield target["name"].replace("-", "_"), label, pkg_dir, exe


def main():
    for row in binaries(sys.stdin):
        print("\t".join(row))


if __name__ == "__main__":
    main()

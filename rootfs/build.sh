#!/bin/sh
# Build an ember root file system image from a template recipe; see rootfs/README.md.
#
#   rootfs/build.sh [--template NAME | --recipe-json PATH] [--print-key] [--rebuild] [--agent PATH]
#
# Progress goes to stderr; on success the last line on stdout is the absolute path of rootfs.ext4.
# The work is done by build.py next to this script (Python >= 3.11); it reads the recipe as
# `ember template check --json` checked it (the template schema is Rust's).
set -eu

here=$(cd "$(dirname "$0")" && pwd)

for py in "${PYTHON:-}" python3 python3.11 python3.12 python3.13; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
        exec "$py" "$here/build.py" "$@"
    fi
done
echo "rootfs/build.sh: error: no Python >= 3.11 found; install python3 or set PYTHON" >&2
exit 1

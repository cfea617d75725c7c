#!/usr/bin/env bash
# Installs the S3-compatible server that tests/cluster.rs runs as the fleet's blob store:
# moto's standalone server (PyPI `moto[server]`, pinned in tests/cluster/requirements.txt),
# into a venv at $EMBER_CACHE/s3/venv-<hash>, <hash> the first 16 hex digits of the SHA-256
# of the pin file (a changed pin makes a new venv; an unchanged one is only checked). The
# venv is marked complete (.ok) only after its install succeeded.
#
# Prints last, on stdout: EMBER_MOTO_SERVER=<path of moto_server>
# Network: PyPI, through pip's own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${EMBER_CACHE:-/var/cache/ember}/s3"
mkdir -p "$cache"
req=tests/cluster/requirements.txt
venv="$cache/venv-$(sha256sum "$req" | cut -c1-16)"
if [[ -f "$venv/.ok" && -x "$venv/bin/moto_server" ]]; then
    echo "moto S3 server: cached in $venv" >&2
else
    echo "moto S3 server: installing into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    "$venv/bin/python" -c 'import moto.server' >&2
    touch "$venv/.ok"
fi
echo "EMBER_MOTO_SERVER=$venv/bin/moto_server"

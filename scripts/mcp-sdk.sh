#!/usr/bin/env bash
# Installs the MCP client tests/mcp.rs uses: the official MCP Python SDK (PyPI `mcp`, pinned
# in tests/mcp/requirements.txt), into a venv at $EMBER_CACHE/mcp/venv-<hash>, <hash> the
# first 16 hex digits of the SHA-256 of the pin file (a changed pin makes a new venv; an
# unchanged one is only checked). The venv is marked complete (.ok) only after its install
# succeeded.
#
# Prints last, on stdout: EMBER_MCP_VENV=<the venv's directory>
# Network: PyPI, through pip's own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${EMBER_CACHE:-/var/cache/ember}/mcp"
mkdir -p "$cache"
req=tests/mcp/requirements.txt
venv="$cache/venv-$(sha256sum "$req" | cut -c1-16)"
if [[ -f "$venv/.ok" && -x "$venv/bin/python" ]]; then
    echo "MCP Python SDK: cached in $venv" >&2
else
    echo "MCP Python SDK: installing into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    "$venv/bin/python" -c 'import mcp.client.stdio, mcp.client.streamable_http' >&2
    touch "$venv/.ok"
fi
echo "EMBER_MCP_VENV=$venv"

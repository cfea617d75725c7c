#!/usr/bin/env bash
# Installs the pinned E2B SDKs that tests/e2b.rs drives against `ember serve`:
#   - Python (tests/e2b/requirements.txt) into a venv at $EMBER_CACHE/e2b/venv-<hash>;
#   - JavaScript (tests/e2b/package-lock.json, `npm ci`) into $EMBER_CACHE/e2b/node-<hash>.
# <hash> is the first 16 hex digits of the SHA-256 of the pin file, so a changed pin makes a
# new directory and an unchanged one is reused (a second run only checks). Each directory is
# marked complete (.ok) only after its install succeeded; a partial one is redone.
#
# Prints the two paths last, as shell assignments (what scripts/test.sh exports for the test):
#   EMBER_E2B_VENV=<venv dir>            (python: $EMBER_E2B_VENV/bin/python)
#   EMBER_E2B_NODE_MODULES=<node_modules dir>
# Network: PyPI and the npm registry, through pip's and npm's own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${EMBER_CACHE:-/var/cache/ember}/e2b"
mkdir -p "$cache"

hash16() { sha256sum "$1" | cut -c1-16; }

# --- Python
req=tests/e2b/requirements.txt
venv="$cache/venv-$(hash16 "$req")"
if [[ -f "$venv/.ok" ]] && "$venv/bin/python" -c 'import e2b, e2b_code_interpreter' 2>/dev/null; then
    echo "e2b python SDK: cached in $venv" >&2
else
    echo "e2b python SDK: installing into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    "$venv/bin/python" -c 'import e2b, e2b_code_interpreter'
    touch "$venv/.ok"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE '^e2b' >&2 || true

# --- JavaScript
lock=tests/e2b/package-lock.json
node_dir="$cache/node-$(hash16 "$lock")"
if [[ -f "$node_dir/.ok" && -d "$node_dir/node_modules/e2b" ]]; then
    echo "e2b JS SDK: cached in $node_dir" >&2
else
    command -v npm >/dev/null || { echo "npm not found (install nodejs and npm)" >&2; exit 1; }
    echo "e2b JS SDK: installing into $node_dir (node $(node --version))" >&2
    rm -rf "$node_dir"
    mkdir -p "$node_dir"
    cp tests/e2b/package.json "$lock" "$node_dir/"
    (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
    touch "$node_dir/.ok"
fi
for p in e2b @e2b/code-interpreter; do
    printf '  %s %s\n' "$p" "$(node -p "require('$node_dir/node_modules/$p/package.json').version")" >&2
done

echo "EMBER_E2B_VENV=$venv"
echo "EMBER_E2B_NODE_MODULES=$node_dir/node_modules"

#!/usr/bin/env bash
# Installs the pinned CDP clients that tests/browser.rs drives against `ember serve` (the
# Playwright venv also drives the dashboard in tests/ui.rs):
#   - Playwright for Python (tests/browser/requirements.txt) into a venv at
#     $EMBER_CACHE/browser/venv-<hash> (the package only: `connect_over_cdp` needs no
#     downloaded browser, so `playwright install` is never run);
#   - puppeteer-core (tests/browser/package-lock.json, `npm ci`) into
#     $EMBER_CACHE/browser/node-<hash> (puppeteer-core never downloads a browser).
# <hash> is the first 16 hex digits of the SHA-256 of the pin file, so a changed pin makes a
# new directory and an unchanged one is reused (a second run only checks). Each directory is
# marked complete (.ok) only after its install succeeded; a partial one is redone.
#
# Prints the two paths last, as shell assignments (what scripts/test.sh exports for the test):
#   EMBER_BROWSER_VENV=<venv dir>            (python: $EMBER_BROWSER_VENV/bin/python)
#   EMBER_BROWSER_NODE_MODULES=<node_modules dir>
# Network: PyPI and the npm registry, through pip's and npm's own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${EMBER_CACHE:-/var/cache/ember}/browser"
mkdir -p "$cache"

hash16() { sha256sum "$1" | cut -c1-16; }

# --- Python
req=tests/browser/requirements.txt
venv="$cache/venv-$(hash16 "$req")"
if [[ -f "$venv/.ok" ]] && "$venv/bin/python" -c 'import playwright.sync_api' 2>/dev/null; then
    echo "playwright (python): cached in $venv" >&2
else
    echo "playwright (python): installing into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    "$venv/bin/python" -c 'import playwright.sync_api'
    touch "$venv/.ok"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE '^playwright' >&2 || true

# --- JavaScript
lock=tests/browser/package-lock.json
node_dir="$cache/node-$(hash16 "$lock")"
if [[ -f "$node_dir/.ok" && -d "$node_dir/node_modules/puppeteer-core" ]]; then
    echo "puppeteer-core: cached in $node_dir" >&2
else
    command -v npm >/dev/null || { echo "npm not found (install nodejs and npm)" >&2; exit 1; }
    echo "puppeteer-core: installing into $node_dir (node $(node --version))" >&2
    rm -rf "$node_dir"
    mkdir -p "$node_dir"
    cp tests/browser/package.json "$lock" "$node_dir/"
    (cd "$node_dir" && PUPPETEER_SKIP_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error >&2)
    touch "$node_dir/.ok"
fi
printf '  puppeteer-core %s\n' "$(node -p "require('$node_dir/node_modules/puppeteer-core/package.json').version")" >&2

echo "EMBER_BROWSER_VENV=$venv"
echo "EMBER_BROWSER_NODE_MODULES=$node_dir/node_modules"

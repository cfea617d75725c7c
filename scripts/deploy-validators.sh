#!/usr/bin/env bash
# Installs what scripts/validate-deploy.py (and so tests/deploy.rs) needs to check deploy/
# offline: the pinned kubernetes-validate (Kubernetes' JSON schemas), python-hcl2 (Nomad's
# job files) and PyYAML of tests/deploy/requirements.txt, into a venv at
# $EMBER_CACHE/deploy-validators/<hash>, where <hash> is the first 16 hex digits of the
# SHA-256 of that pin file: a changed pin makes a new venv, an unchanged one is reused (a
# second run only checks). The venv is marked complete (.ok) only after its install
# succeeded; a partial one is redone. (systemd-analyze, the third validator, is Debian's
# `systemd` package: scripts/test-prereqs.sh installs it.)
#
# Prints the interpreter last, as a shell assignment (what scripts/test.sh exports):
#   EMBER_DEPLOY_PY=<venv>/bin/python
# Network: PyPI, through pip's own configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${EMBER_CACHE:-/var/cache/ember}/deploy-validators"
mkdir -p "$cache"

req=tests/deploy/requirements.txt
venv="$cache/$(sha256sum "$req" | cut -c1-16)"
probe='import kubernetes_validate, hcl2, yaml'
if [[ -f "$venv/.ok" ]] && "$venv/bin/python" -c "$probe" 2>/dev/null; then
    echo "deploy validators: cached in $venv" >&2
else
    echo "deploy validators: installing into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    "$venv/bin/python" -c "$probe"
    touch "$venv/.ok"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
    grep -iE '^(kubernetes-validate|python-hcl2|pyyaml) ' >&2 || true

echo "EMBER_DEPLOY_PY=$venv/bin/python"

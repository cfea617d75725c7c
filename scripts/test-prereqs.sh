#!/usr/bin/env bash
# Installs what the tests need beyond what scripts/setup.sh installs for building ember: the
# one install path for the test prerequisites, used by scripts/test.sh (the README's test
# command) and by .ci/run. On a fresh Debian 12 machine it installs; when everything is there
# it only checks (a few seconds). Needs root (apt-get) and the network (Debian's mirror, PyPI,
# the npm registry) for what is missing.
#   - Debian packages: the python3-* packages (the agent's context tests run the guest's IPython
#     driver on the host, against the same packages the templates install), python3-venv (the
#     venvs below), chromium (tests/browser.rs's live view, tests/bench.rs's HTML report), ip,
#     nft and unshare (tests/network.rs, tests/browser.rs, tests/cli_errors.rs), gcc
#     (tests/guest_cpu_state.rs), systemd (systemd-analyze verify, for tests/deploy.rs),
#     docker-registry (tests/oci.rs's local registry, in a namespace of its own) and
#     busybox-static (tests/oci.rs's image without Python), a JDK (the agent's Java context test
#     runs the guest's jshell driver on the host);
#     Node.js and npm when there is no `node` (the E2B JS SDK wants Node >= 20.18.1 and
#     Debian 12's nodejs is 18, so an existing newer `node` is kept and apt's is only the
#     fallback);
#   - the pinned E2B SDKs (scripts/e2b-sdks.sh, for tests/e2b.rs), CDP clients
#     (scripts/browser-clients.sh, for tests/browser.rs and the dashboard's tests/ui.rs), moto's S3 server
#     (scripts/s3-server.sh, for tests/cluster.rs), deploy/ validators
#     (scripts/deploy-validators.sh, for tests/deploy.rs) and the MCP Python SDK
#     (scripts/mcp-sdk.sh, for tests/mcp.rs), each cached by the hash of its pins.
#
# Usage: test-prereqs.sh [--packages | --clients]   (default: both; .ci/run runs the two parts
# in steps of their own, scripts/test.sh the whole).
#
# Progress goes to stderr. Prints last, on stdout, the EMBER_*=path lines of those scripts
# (what scripts/test.sh exports for the tests). Every part is tried; the exit status is 1 when
# any failed (each failure is named on stderr), and the lines of the parts that worked are
# still printed.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=true clients=true
case "${1:-}" in
    "") ;;
    --packages) clients=false ;;
    --clients) packages=false ;;
    *) echo "usage: $0 [--packages | --clients]" >&2; exit 2 ;;
esac

failed=()
lines=()

# --- Debian packages
if $packages; then
    pkgs=(python3 python3-venv python3-ipython python3-matplotlib python3-matplotlib-inline
          python3-pandas python3-openpyxl chromium iproute2 nftables util-linux gcc
          postgresql systemd docker-registry busybox-static openjdk-17-jdk-headless)
    missing=()
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    command -v node >/dev/null || missing+=(nodejs npm)
    if ((${#missing[@]})); then
        echo "test prerequisites: installing ${missing[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        if ! { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }; then
            failed+=("apt-get install ${missing[*]}")
        fi
    else
        echo "test prerequisites: Debian packages present" >&2
    fi
    # docker-registry's package enables a host-wide registry on :5000; tests/oci.rs runs its
    # own in a namespace, so the service stays off.
    if [ -d /run/systemd/system ] && systemctl is-enabled docker-registry >/dev/null 2>&1; then
        systemctl disable --now docker-registry >&2 || failed+=("systemctl disable docker-registry")
    fi
fi

# --- Pinned client libraries (they need python3-venv and npm from above); their EMBER_* lines
# are kept for the end, anything else they print on stdout goes to stderr.
if $clients; then
    for script in scripts/e2b-sdks.sh scripts/browser-clients.sh scripts/s3-server.sh \
                  scripts/deploy-validators.sh scripts/mcp-sdk.sh; do
        if out=$(bash "$script"); then
            while IFS= read -r line; do
                if [[ $line =~ ^EMBER_[A-Z0-9_]+= ]]; then
                    lines+=("$line")
                elif [[ -n $line ]]; then
                    printf '%s\n' "$line" >&2
                fi
            done <<<"$out"
        else
            failed+=("$script")
        fi
    done
fi

if ((${#failed[@]})); then
    printf 'test prerequisites: FAILED: %s\n' "${failed[@]}" >&2
fi
if ((${#lines[@]})); then
    printf '%s\n' "${lines[@]}"
fi
((${#failed[@]} == 0))

#!/usr/bin/env bash
# The test command: builds every binary (the end-to-end tests run the real `ember`,
# `ember-vmm` and `ember-jailer`), then runs all unit and integration tests. Needs root and
# /dev/kvm; builds the guest kernel and rootfs on first use if they are not cached.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
# The pinned E2B SDKs that tests/e2b.rs drives (cached; .ci/run has already done this).
if [[ -z "${EMBER_E2B_VENV:-}" ]]; then
    if e2b_env=$(bash scripts/e2b-sdks.sh); then
        EMBER_E2B_VENV=$(sed -n 's/^EMBER_E2B_VENV=//p' <<<"$e2b_env")
        EMBER_E2B_NODE_MODULES=$(sed -n 's/^EMBER_E2B_NODE_MODULES=//p' <<<"$e2b_env")
        export EMBER_E2B_VENV EMBER_E2B_NODE_MODULES
    else
        echo "warning: the E2B SDKs could not be installed; tests/e2b.rs will say so" >&2
    fi
fi
# The pinned CDP clients that tests/browser.rs drives (Playwright for Python, puppeteer-core).
if [[ -z "${EMBER_BROWSER_VENV:-}" ]]; then
    if browser_env=$(bash scripts/browser-clients.sh); then
        EMBER_BROWSER_VENV=$(sed -n 's/^EMBER_BROWSER_VENV=//p' <<<"$browser_env")
        EMBER_BROWSER_NODE_MODULES=$(sed -n 's/^EMBER_BROWSER_NODE_MODULES=//p' <<<"$browser_env")
        export EMBER_BROWSER_VENV EMBER_BROWSER_NODE_MODULES
    else
        echo "warning: the CDP clients could not be installed; tests/browser.rs will say so" >&2
    fi
fi
python3 -m unittest discover -s rootfs -p "test_*.py"
# Guest boots are slow on kvm_pvm and the machine has 2 cores: two test threads.
cargo test --workspace --no-fail-fast -- --test-threads=2

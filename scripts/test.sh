#!/usr/bin/env bash
# The test command: builds every binary (the end-to-end tests run the real `ember`,
# `ember-vmm` and `ember-jailer`), then runs all unit and integration tests. Needs root and
# /dev/kvm; builds the guest kernel and rootfs on first use if they are not cached.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
# Runs installer $1 (it prints EMBER_*=path lines last) and exports what it prints, unless
# variable $2 is set already (.ci/run has done it); a failed install only warns, and the test
# that needs it ($3) says so.
install_and_export() {
    local script=$1 already=$2 test=$3 out line
    [[ -z "${!already:-}" ]] || return 0
    if out=$(bash "$script"); then
        while IFS= read -r line; do
            [[ $line =~ ^EMBER_[A-Z0-9_]+= ]] && export "${line?}"
        done <<<"$out"
    else
        echo "warning: $script failed; $test will say what is missing" >&2
    fi
}
# The pinned E2B SDKs (tests/e2b.rs) and CDP clients (tests/browser.rs: Playwright for
# Python, puppeteer-core), each cached by the hash of its pins.
install_and_export scripts/e2b-sdks.sh EMBER_E2B_VENV tests/e2b.rs
install_and_export scripts/browser-clients.sh EMBER_BROWSER_VENV tests/browser.rs
python3 -m unittest discover -s rootfs -p "test_*.py"
# Guest boots are slow on kvm_pvm and the machine has 2 cores: two test threads.
cargo test --workspace --no-fail-fast -- --test-threads=2

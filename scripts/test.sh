#!/usr/bin/env bash
# The test command: builds every binary (the end-to-end tests run the real `ember`,
# `ember-vmm` and `ember-jailer`), then runs all unit and integration tests. Needs root and
# /dev/kvm; builds the guest kernel and rootfs on first use if they are not cached.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
python3 -m unittest discover -s rootfs -p "test_*.py"
# Guest boots are slow on kvm_pvm and the machine has 2 cores: two test threads.
cargo test --workspace --no-fail-fast -- --test-threads=2

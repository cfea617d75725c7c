#!/usr/bin/env bash
# Runs every fuzz target for a bounded time and exits non-zero if one crashes (or fails to build).
#
#   fuzz/run.sh [TOTAL_SECONDS]        default 60, split evenly across the targets
#
# Environment:
#   FUZZ_TARGETS     space-separated targets (default: all, from `cargo fuzz list`)
#   FUZZ_SANITIZER   address (default) or none (faster, catches panics only)
#
# Works on a stable toolchain: cargo-fuzz passes nightly-only flags (-Z sanitizer, sancov), which
# RUSTC_BOOTSTRAP=1 allows. Needs cargo-fuzz (installed from crates.io if missing) and a C++
# compiler for libFuzzer. New inputs go to a temporary corpus (the committed seeds in
# corpus/<target>/ are only read); a crashing input is saved in artifacts/<target>/ and can be
# replayed with `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> artifacts/<target>/<file>`.
set -euo pipefail
cd "$(dirname "$0")"

total=${1:-${FUZZ_SECONDS:-60}}
sanitizer=${FUZZ_SANITIZER:-address}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "run.sh: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

read -r -a targets <<<"${FUZZ_TARGETS:-$(cargo fuzz list | tr '\n' ' ')}"
if ((${#targets[@]} == 0)); then
    echo "run.sh: no fuzz targets" >&2
    exit 2
fi
per=$((total / ${#targets[@]}))
((per >= 1)) || per=1

work=$(mktemp -d)
# Scratch disk images of the targets (libFuzzer exits without cleaning up after them), on tmpfs
# when there is one: the devices fsync, which costs milliseconds on a real disk.
if [[ -d /dev/shm && -w /dev/shm ]]; then
    scratch=$(mktemp -d -p /dev/shm ember-fuzz.XXXXXX)
else
    scratch="$work/scratch"
    mkdir -p "$scratch"
fi
trap 'rm -rf "$work" "$scratch"' EXIT
export EMBER_FUZZ_SCRATCH="$scratch"

echo "run.sh: building ${targets[*]} (sanitizer $sanitizer)"
for t in "${targets[@]}"; do
    cargo fuzz build --sanitizer "$sanitizer" "$t"
done

failed=()
for t in "${targets[@]}"; do
    mkdir -p "$work/corpus/$t" "artifacts/$t"
    echo "run.sh: fuzzing $t for ${per}s"
    if cargo fuzz run --sanitizer "$sanitizer" "$t" "$work/corpus/$t" "corpus/$t" -- \
        -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="artifacts/$t/" 2>"$work/$t.log"; then
        grep -E '^(Done|stat::number_of_executed_units|stat::average_exec_per_sec)' "$work/$t.log" || true
        echo "run.sh: $t ok"
    else
        tail -n 60 "$work/$t.log" >&2
        echo "run.sh: $t FAILED: crashing input in fuzz/artifacts/$t/" >&2
        failed+=("$t")
    fi
done

if ((${#failed[@]})); then
    echo "run.sh: crashes in ${failed[*]}" >&2
    exit 1
fi
echo "run.sh: all targets ran ${per}s without a crash"

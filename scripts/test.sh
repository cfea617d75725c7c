#!/usr/bin/env bash
# The test command: installs the test prerequisites (scripts/test-prereqs.sh; a quick check
# when they are there), builds every binary (the end-to-end tests run the real `ember`,
# `ember-vmm` and `ember-jailer`), then runs all unit and integration tests, prints the time of
# each test suite (longest first) and ends with one line `tests: N passed, N failed, N skipped`
# and the skipped tests with their reasons. Needs root and /dev/kvm; builds the guest kernel
# and rootfs on first use if they are not cached. Exits non-zero when a test failed. cargo's
# output is also kept in ${CARGO_TARGET_DIR:-target}/test.log.
set -euo pipefail
cd "$(dirname "$0")/.."
ci=false
[[ "${CI:-}" == true ]] && ci=true

# The Debian packages, the pinned E2B SDKs (tests/e2b.rs), CDP clients (tests/browser.rs, tests/ui.rs),
# deploy/ validators (tests/deploy.rs) and the MCP Python SDK (tests/mcp.rs).
# The EMBER_* paths it prints are exported, unless set already. A failed install stops the run
# under CI=true; elsewhere it warns, and the tests that need what is missing are skipped and
# listed at the end.
prereqs_ok=true
prereqs=$(bash scripts/test-prereqs.sh) || prereqs_ok=false
while IFS= read -r line; do
    [[ $line =~ ^(EMBER_[A-Z0-9_]+)= ]] || continue
    [[ -n "${!BASH_REMATCH[1]:-}" ]] || export "${line?}"
done <<<"$prereqs"
if ! $prereqs_ok; then
    if $ci; then
        echo "error: scripts/test-prereqs.sh failed (CI=true: the tests would fail on it)" >&2
        exit 1
    fi
    echo "warning: scripts/test-prereqs.sh failed; the tests that need what is missing will be" \
        "skipped (listed at the end)" >&2
fi

cargo build --workspace --bins
# rootfs/build.py reads recipes as `ember template check` prints them: the binary just built.
EMBER_BIN="${EMBER_BIN:-${CARGO_TARGET_DIR:-target}/debug/ember}" \
    python3 -m unittest discover -s rootfs -p "test_*.py"

# Each skip (ember_tests::skip) appends `<test>: <why>` here.
EMBER_SKIP_LOG=$(mktemp -t ember-skips.XXXXXX)
export EMBER_SKIP_LOG
trap 'rm -f "$EMBER_SKIP_LOG"' EXIT
log="${CARGO_TARGET_DIR:-target}/test.log"
mkdir -p "$(dirname "$log")"
# Guest boots are slow on kvm_pvm and the machine has 2 cores: two test threads.
status=0
test_start=$SECONDS
# cargo's exit status (or 1 when only the tee failed), not the pipeline's.
cargo test --workspace --no-fail-fast -- --test-threads=2 2>&1 | tee "$log" ||
    status=$((PIPESTATUS[0] ? PIPESTATUS[0] : 1))
test_wall=$((SECONDS - test_start))

# Where the time went: each test binary (a suite: one file of integration tests, a crate's unit
# tests or doc-tests) with the `finished in` of its `test result:` line, longest first. The
# binaries run one after another, so these add up to the run's time less the build. Suites
# under a second are summed in one line.
echo
echo "suite times (seconds, longest first):"
awk '
    /^ +Running / {
        # "Running files_exec.rs (target/debug/deps/files_exec-<hash>)" or
        # "Running unittests src/lib.rs (target/debug/deps/ember_agent-<hash>)"
        bin = $NF; gsub(/[()]/, "", bin); sub(/.*\//, "", bin); sub(/-[0-9a-f]+$/, "", bin)
        name = ($2 == "unittests") ? bin " (unit tests, " $3 ")" : bin
        next
    }
    /^ +Doc-tests / { name = $2 " (doc-tests)"; next }
    /^test result:/ && name != "" {
        for (i = 1; i < NF; i++) if ($i == "finished" && $(i + 1) == "in") secs = $(i + 2)
        sub(/s$/, "", secs)
        printf "%s\t%s\n", secs + 0, name
        name = ""
    }' "$log" | sort -t $'\t' -k1,1 -rn | awk -F '\t' -v wall="$test_wall" '
    $1 >= 1 { printf "  %7.1f  %s\n", $1, $2 }
    $1 < 1 { small++; small_secs += $1 }
    { total += $1 }
    END {
        if (small) printf "  %7.1f  (%d suites under 1 s each)\n", small_secs, small
        printf "  %7.1f  all suites; cargo test took %d s with building the tests\n", total, wall
    }'

# The summary: the sums of every `test result:` line, and the skip log.
read -r passed failed ignored < <(awk '
    /^test result:/ {
        for (i = 2; i <= NF; i++) {
            w = $i; sub(/[;,.]$/, "", w)
            if (w == "passed") p += $(i - 1)
            else if (w == "failed") f += $(i - 1)
            else if (w == "ignored") g += $(i - 1)
        }
    }
    END { printf "%d %d %d\n", p, f, g }' "$log")
skipped=$(grep -c . "$EMBER_SKIP_LOG" || true)
echo
echo "tests: $passed passed, $failed failed, $skipped skipped"
echo "($ignored ignored: #[ignore] tests, run by hand)"
if ((skipped)); then
    echo "skipped:"
    sed 's/^/  /' "$EMBER_SKIP_LOG"
fi
if ((failed)); then
    echo "failed:"
    grep -E '^test .* \.\.\. FAILED$' "$log" | sed -E 's/^test (.*) \.\.\. FAILED$/  \1/' || true
fi
if ((status != 0)); then
    echo "cargo test exited with status $status (full output: $log)"
fi
exit "$status"

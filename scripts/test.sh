#!/usr/bin/env bash
# The test command: installs the test prerequisites (scripts/test-prereqs.sh; a quick check
# when they are there), builds every binary (the end-to-end tests run the real `ember`,
# `ember-vmm` and `ember-jailer`), then runs all unit and integration tests, prints the time of
# each test suite (longest first) and ends with one line `tests: N passed, N failed, N skipped`
# and the skipped tests with their reasons. Needs root and /dev/kvm; builds the guest kernel
# and rootfs on first use if they are not cached. Exits non-zero when a test failed. The tests'
# output is also kept in ${CARGO_TARGET_DIR:-target}/test.log. The suites run in two lanes
# side by side (below).
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
log="${CARGO_TARGET_DIR:-target}/test.log"
mkdir -p "$(dirname "$log")"
# The test binaries run in two lanes side by side, each binary with two test threads: a lane
# of suites that mostly wait (fleet nodes, SDK processes, timeouts) beside a lane of suites
# that mostly run guests, which roughly halves the wall time on 2 cores. Suites that count
# host-wide resources run alone afterwards; doc-tests last. EMBER_TEST_LANES=1 runs every
# binary one after another (the order cargo gives), as `cargo test` would; EMBER_TEST_ONLY=REGEX
# runs only the suites whose name matches (doc-tests aside).
# Lane "a": the suites named here; everything else is lane "b".
# Balanced by a fresh CI run's suite times (2026-12-07): lane a 1,650 s, lane b 1,630 s.
lane_a=(e2b cluster cluster_faults volumes ui mcp deploy server network oci languages)
# Alone: runtime_leaks counts this process's mounts, which other suites' namespaces change;
# bench measures.
alone=(runtime_leaks bench)
status=0
test_start=$SECONDS
lanes_dir=$(mktemp -d -t ember-test-lanes.XXXXXX)
trap 'rm -f "$EMBER_SKIP_LOG"; rm -rf "$lanes_dir"' EXIT
# Build every test binary first (cargo's messages on the terminal, its JSON to the lister).
if ! cargo test --workspace --no-run --message-format=json-render-diagnostics |
    python3 scripts/test-binaries.py >"$lanes_dir/binaries"; then
    echo "error: building the tests failed" >&2
    exit 101
fi
in_list() { # NAME LIST...
    local n=$1 x
    shift
    for x in "$@"; do [[ $x == "$n" ]] && return 0; done
    return 1
}
: >"$lanes_dir/a.list"
: >"$lanes_dir/b.list"
: >"$lanes_dir/alone.list"
while IFS=$'\t' read -r name label dir exe; do
    [[ -z ${EMBER_TEST_ONLY:-} || $name =~ $EMBER_TEST_ONLY ]] || continue
    lane=b
    if [[ ${EMBER_TEST_LANES:-2} != 1 ]] && in_list "$name" "${lane_a[@]}"; then
        lane=a
    elif in_list "$name" "${alone[@]}" && [[ $label != unittests* ]]; then
        lane=alone
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$label" "$dir" "$exe" >>"$lanes_dir/$lane.list"
done <"$lanes_dir/binaries"
# run_lane LIST LOG: runs each binary of LIST in its package's directory (as cargo does), its
# output to LOG under a `Running` line like cargo's; non-zero when any of them failed.
run_lane() {
    local list=$1 out=$2 failed=0 name label dir exe
    while IFS=$'\t' read -r name label dir exe; do
        printf '     Running %s (%s)\n' "$label" "$exe" >>"$out"
        (cd "$dir" && "$exe" --test-threads=2) >>"$out" 2>&1 </dev/null || failed=1
    done <"$list"
    return "$failed"
}
# Each lane's output is followed on the terminal as it comes, its lines prefixed with the
# lane (tail --pid reads to the end once the lane is done).
lane_pids=()
for lane in a b; do
    : >"$lanes_dir/$lane.log"
    run_lane "$lanes_dir/$lane.list" "$lanes_dir/$lane.log" &
    lane_pids+=($!)
    tail -n +1 -f --pid=$! "$lanes_dir/$lane.log" | sed -u "s/^/[$lane] /" &
done
for pid in "${lane_pids[@]}"; do
    wait "$pid" || status=101
done
wait
: >"$lanes_dir/alone.log"
run_lane "$lanes_dir/alone.list" "$lanes_dir/alone.log" || status=101
cat "$lanes_dir/alone.log"
cargo test --workspace --doc >"$lanes_dir/doc.log" 2>&1 || status=101
cat "$lanes_dir/doc.log"
cat "$lanes_dir/a.log" "$lanes_dir/b.log" "$lanes_dir/alone.log" "$lanes_dir/doc.log" >"$log"
test_wall=$((SECONDS - test_start))

# Where the time went: each test binary (a suite: one file of integration tests, a crate's unit
# tests or doc-tests) with the `finished in` of its `test result:` line, longest first. The
# lanes run side by side, so these add up to more than the run's time. Suites under a second
# are summed in one line.
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
        printf "  %7.1f  all suites; the tests took %d s with building them\n", total, wall
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
    # Why each one failed: the end of its captured output (the panic message is there), so
    # that a CI report that keeps only the head and the tail of the output still says it.
    grep -E '^test .* \.\.\. FAILED$' "$log" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' |
        while read -r name; do
            echo
            echo "-- the end of $name's output:"
            awk -v head="---- $name stdout ----" '
                $0 == head { on = 1; n = 0; next }
                on && /^(failures:|---- .* stdout ----)$/ { on = 0 }
                on { buf[n++ % 40] = $0 }
                END { for (i = (n > 40 ? n - 40 : 0); i < n; i++) print "   " buf[i % 40] }
            ' "$log"
        done
fi
if ((status != 0)); then
    echo "a test binary failed (status $status; full output: $log)"
fi
exit "$status"

#!/usr/bin/env bash
# The peer of scripts/bench-browser.py: a freshly started Chromium in a freshly booted guest
# (no snapshot). Boots the `browser` template's root filesystem with `ember vm boot` (same
# kernel, 1 vCPU, the recipe's memory), and in the guest starts Chromium with the template's
# flags on a `data:` page, polling its DevTools /json/list (bash /dev/tcp) until the page's
# title shows: the time from Chromium's exec to "first page loaded", by the guest's clock.
# Prints one JSON line per run: boot_marker_ms (VMM spawn → guest init) and chromium_ms.
# Usage: scripts/bench-browser-cold.sh [N] (default 3); needs root, /dev/kvm, a built rootfs.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
ember=${EMBER:-target/release/ember}
[[ -x $ember ]] || ember=target/debug/ember
mem=$(python3 -c 'import tomllib;print(tomllib.load(open("rootfs/templates/browser.toml","rb"))["vm"]["memory_mib"])')
read -r -d '' guest <<'GUEST' || true
mkdir -p /tmp/h; export HOME=/tmp/h
t0=$(date +%s%N)
/usr/lib/chromium/chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --user-data-dir=/tmp/h/profile --remote-debugging-port=9223 --no-first-run \
  --no-default-browser-check --no-proxy-server --disable-background-networking \
  --disable-component-update --disable-sync --disable-default-apps --disable-extensions \
  --disable-breakpad --disable-domain-reliability --disable-client-side-phishing-detection \
  --metrics-recording-only --password-store=basic --mute-audio --window-size=1280,720 \
  'data:text/html,<title>coldbench</title><h1>first page</h1>' >/tmp/h/log 2>&1 &
until bash -c 'exec 3<>/dev/tcp/127.0.0.1/9223 && printf "GET /json/list HTTP/1.0\r\nHost: localhost\r\n\r\n" >&3 && grep -q "\"title\": \"coldbench\"" <&3' 2>/dev/null; do
  sleep 0.2
done
t1=$(date +%s%N)
echo "CHROMIUM_MS $(( (t1 - t0) / 1000000 ))"
GUEST
for i in $(seq 1 "$n"); do
    out=$("$ember" vm boot --template browser --mem-mib "$mem" --json --timeout 1800 --run "$guest" 2>/tmp/bench-browser-cold.console)
    ms=$(grep -ao 'CHROMIUM_MS [0-9]*' /tmp/bench-browser-cold.console | awk '{print $2}')
    boot=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read()).get("boot_marker_ms"))' <<<"$out")
    echo "{\"run\": $i, \"boot_marker_ms\": $boot, \"chromium_ms\": ${ms:-null}}"
done

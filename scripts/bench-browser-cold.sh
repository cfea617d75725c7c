#!/usr/bin/env bash
# The peer of scripts/bench-browser.py: a freshly started Chromium in a freshly booted guest
# (no snapshot). Boots the `browser` template's root filesystem with `ember vm boot` (same
# kernel, 1 vCPU, the recipe's memory), and in the guest starts the recipe's own Chromium
# command (its `chromium` service's argv, run as `user`) on a `data:` page instead of
# about:blank, polling its DevTools /json/list until the page's title shows: the time from
# Chromium's exec to "first page loaded", by the guest's clock. The poll uses bash built-ins
# only, every 2 s (under kvm_pvm each exec in the guest costs seconds of its only vCPU).
# Prints one JSON line per run: boot_marker_ms (VMM spawn → guest init) and chromium_ms.
# Usage: scripts/bench-browser-cold.sh [N] (default 3); needs root, /dev/kvm, the template's
# root filesystem (`ember template build browser` builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
ember=${EMBER:-target/release/ember}
[[ -x $ember ]] || ember=target/debug/ember
read -r mem argv < <(python3 - <<'PY'
import shlex, tomllib
r = tomllib.load(open("rootfs/templates/browser.toml", "rb"))
svc = next(s for s in r["warmup"]["services"] if s["name"] == "chromium")
argv = [a for a in svc["argv"] if a != "about:blank"]
argv.append("data:text/html,<title>coldbench</title><h1>first page</h1>")
print(r["vm"]["memory_mib"], shlex.join(argv))
PY
)
guest=$(cat <<GUEST
mkdir -p /tmp/browser && chown 1000:1000 /tmp/browser
read -r t0 _ < /proc/uptime
setpriv --reuid=1000 --regid=1000 --clear-groups env HOME=/tmp/browser $argv >/tmp/chromium.log 2>&1 &
mkfifo /tmp/tick; exec 9<>/tmp/tick
while :; do
  read -t 2 -u 9
  exec 3<>/dev/tcp/127.0.0.1/9223 2>/dev/null || continue
  printf 'GET /json/list HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' >&3
  hit=; while read -r l; do [[ \$l == *'"title": "coldbench"'* ]] && hit=1; done <&3; exec 3>&-
  [[ -n \$hit ]] && break
done
read -r t1 _ < /proc/uptime
echo "CHROMIUM_S \$t0 \$t1"
GUEST
)
for i in $(seq 1 "$n"); do
    out=$("$ember" vm boot --template browser --mem-mib "$mem" --json --timeout 3600 --run "$guest" 2>/tmp/bench-browser-cold.console)
    ms=$(grep -ao 'CHROMIUM_S [0-9.]* [0-9.]*' /tmp/bench-browser-cold.console | awk '{printf "%d", ($3 - $2) * 1000}')
    boot=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read()).get("boot_marker_ms"))' <<<"$out")
    echo "{\"run\": $i, \"boot_marker_ms\": $boot, \"chromium_ms\": ${ms:-null}}"
done

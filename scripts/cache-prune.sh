#!/usr/bin/env bash
# Keeps room on the disk that holds ember's build cache ($EMBER_CACHE, /var/cache/ember by
# default): when less than --want GiB is free there, removes cache entries (the keyed
# directories and files under $EMBER_CACHE/<kind>/: kernels, root filesystems, templates,
# Dockerfile steps, client installs), the least recently modified first, until --want GiB is
# free or nothing older than --keep-hours is left. An entry removed is rebuilt when next needed.
# Exits 1, naming what fills the disk, when even then less than --need GiB is free: a build
# would fail later on "No space left on device" with no word on why. .ci/run runs it first.
#
# Usage: scripts/cache-prune.sh [--want GIB] [--need GIB] [--keep-hours H] [--dry-run]
set -euo pipefail
want=30
need=12
keep_hours=2
dry=false
while (($#)); do
    case $1 in
    --want) want=$2; shift 2 ;;
    --need) need=$2; shift 2 ;;
    --keep-hours) keep_hours=$2; shift 2 ;;
    --dry-run) dry=true; shift ;;
    -h | --help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cache-prune: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
cache=${EMBER_CACHE:-/var/cache/ember}
mkdir -p "$cache"
free_gib() { df -P -B1G "$cache" | awk 'NR == 2 { print $4 }'; }
free=$(free_gib)
echo "cache-prune: $free GiB free on the disk of $cache (want $want, need $need)"
if ((free < want)); then
    now=$(date +%s)
    # Entries: <kind>/<entry>, oldest first; lock files and anything touched in the last
    # --keep-hours (a build that may be using it) are left alone.
    while IFS=$'\t' read -r mtime entry; do
        ((free >= want)) && break
        ((now - ${mtime%.*} < keep_hours * 3600)) && break
        size=$(du -sh "$entry" 2>/dev/null | cut -f1)
        if $dry; then
            echo "cache-prune: would remove $entry ($size)"
        else
            echo "cache-prune: removing $entry ($size)"
            rm -rf -- "$entry"
        fi
        free=$(free_gib)
    done < <(find "$cache" -mindepth 2 -maxdepth 2 ! -name '.*' ! -name '*.lock' \
        -printf '%T@\t%p\n' | sort -n)
    echo "cache-prune: $free GiB free now"
fi
if ((free < need)); then
    echo "cache-prune: error: only $free GiB free on the disk of $cache, and a build needs" \
        "about $need GiB (the Rust target directory, guest images, snapshots). The largest" \
        "directories there:" >&2
    du -xh -d 2 "$(df -P "$cache" | awk 'NR == 2 { print $6 }')" 2>/dev/null |
        sort -rh | head -n 15 >&2 || true
    exit 1
fi

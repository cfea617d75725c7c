#!/usr/bin/env bash
# Sets a fresh Debian 12 machine up to run ember: host packages, the release binaries, the
# guest kernel, the default root filesystem and the default template (all cached in
# $EMBER_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential flex bison bc libelf-dev libssl-dev linux-source-6.1 xz-utils lz4
      mmdebstrap e2fsprogs util-linux iproute2 nftables python3)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "ember: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q && apt-get install -y -q "${missing[@]}"
fi
echo "ember: building the release binaries" >&2
cargo build --release --workspace --bins
echo "ember: building (or finding in the cache) the guest kernel and rootfs" >&2
target/release/ember images
echo "ember: building (or finding in the cache) the default template (boot, warm-up, snapshot)" >&2
target/release/ember template build default

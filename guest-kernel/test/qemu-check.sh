#!/usr/bin/env bash
# Boot the built guest kernel under QEMU TCG (no KVM needed) with a tiny ext4
# root whose /sbin/init is test/init.c, and check that every test passes.
# That init also makes system calls by jumping to entry_SYSCALL_64 from user
# mode, which is exactly the page fault patch 0003 turns into a syscall.
#
#   guest-kernel/test/qemu-check.sh [KERNEL_DIR]   (default: output of build.sh)
#
# Needs: qemu-system-x86, e2fsprogs, gcc with static glibc (libc6-dev).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K=${1:-$("$HERE/../build.sh" | tail -n1)}
[[ -f $K/vmlinux && -f $K/System.map ]] || { echo "no kernel in $K" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || { echo "install qemu-system-x86" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
mkdir -p "$work/root/sbin" "$work/root/dev" "$work/root/proc" "$work/root/sys" "$work/root/tmp"
gcc -O2 -static -Wall -o "$work/root/sbin/init" "$HERE/init.c"
awk '$3 == "entry_SYSCALL_64" { print $1 }' "$K/System.map" >"$work/root/entry"
mkfs.ext4 -q -d "$work/root" "$work/root.img" 16M >/dev/null

status=0
for image in vmlinux bzImage; do
    log=$work/$image.log
    timeout 300 qemu-system-x86_64 -M microvm,acpi=off -cpu max -m 128 -nographic -no-reboot \
        -kernel "$K/$image" \
        -drive id=root,file="$work/root.img",format=raw,if=none,snapshot=on \
        -device virtio-blk-device,drive=root \
        -append "console=ttyS0 reboot=t panic=1 root=/dev/vda ro quiet rodata=off noreplace-smp tsc=reliable noxsave clearcpuid=151,308,297,580" \
        >"$log" 2>&1 || true
    if grep -q 'ember-test-init: ALL PASSED' "$log"; then
        echo "$image: all tests passed ($(grep -c '^PASS' "$log") checks)"
    else
        echo "$image: FAILED" >&2
        cat "$log" >&2
        status=1
    fi
done
exit $status

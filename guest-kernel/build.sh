#!/usr/bin/env bash
# Build ember's guest kernel into a content-addressed cache.
#
#   guest-kernel/build.sh               build if needed; last stdout line = artifact dir
#   guest-kernel/build.sh --print-key   print the cache key only
#
# The key is a sha256 over the linux-source-6.1 package version, the config
# fragment, every patch and this script. Artifacts (vmlinux, bzImage, config,
# System.map) land in $EMBER_CACHE/kernel/<key>/ (EMBER_CACHE defaults to
# /var/cache/ember). See README.md.
#
# stdout carries only the result; everything else goes to stderr.

set -euo pipefail

readonly SRC_PKG=linux-source-6.1
readonly SRC_TARBALL=/usr/src/linux-source-6.1.tar.xz
readonly SRC_TOPDIR=linux-source-6.1
# Bump when the way the source tree is prepared changes (forces a fresh
# source tree and object directory; see srckey below).
readonly SRC_LAYOUT_VERSION=1
# Symbols ember depends on (see README.md); verified in the final .config.
readonly REQUIRED_Y=(
    64BIT SMP PRINTK PRINTK_TIME TTY SERIAL_8250 SERIAL_8250_CONSOLE
    VIRTIO_MMIO VIRTIO_MMIO_CMDLINE_DEVICES VIRTIO_BLK VIRTIO_NET
    VSOCKETS VIRTIO_VSOCKETS NET UNIX INET
    EXT4_FS OVERLAY_FS TMPFS DEVTMPFS DEVTMPFS_MOUNT PROC_FS PROC_SYSCTL SYSFS FUSE_FS
    CGROUPS MEMCG CGROUP_PIDS CGROUP_SCHED
    HYPERVISOR_GUEST PARAVIRT KVM_GUEST PVH DEVPORT
    BINFMT_ELF BINFMT_SCRIPT MULTIUSER FUTEX EPOLL SIGNALFD TIMERFD EVENTFD
    SHMEM AIO FILE_LOCKING POSIX_TIMERS FHANDLE INOTIFY_USER UNIX98_PTYS
    HZ_100 CC_OPTIMIZE_FOR_PERFORMANCE INIT_STACK_NONE
)
readonly REQUIRED_OFF=(
    MODULES X86_5LEVEL SWAP INPUT SERIO VT VGA_CONSOLE LEGACY_PTYS
    PTP_1588_CLOCK PTP_1588_CLOCK_KVM
)
readonly APT_DEPS=(build-essential flex bison bc libelf-dev libssl-dev
                   linux-source-6.1 xz-utils lz4)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
readonly FRAGMENT=$HERE/config-fragment
readonly PATCH_DIR=$HERE/patches
readonly SELF=$HERE/build.sh

log() { printf 'ember: %s\n' "$*" >&2; }
die() { printf 'ember: error: %s\n' "$*" >&2; exit 1; }

usage() {
    cat >&2 <<EOF
usage: $0 [--print-key]

Builds ember's guest kernel (Debian $SRC_PKG + config-fragment + patches/)
into \$EMBER_CACHE/kernel/<key>/ (EMBER_CACHE defaults to /var/cache/ember)
unless it is already there. On success the last line of stdout is that
directory. --print-key prints the cache key and exits without building.
EOF
}

print_key=0
for arg in "$@"; do
    case $arg in
        --print-key) print_key=1 ;;
        -h|--help) usage; exit 0 ;;
        *) usage; die "unknown argument: $arg" ;;
    esac
done

# ---------------------------------------------------------------- inputs ---

[[ -f $FRAGMENT ]] || die "missing config fragment: $FRAGMENT"
[[ -d $PATCH_DIR ]] || die "missing patch directory: $PATCH_DIR"
shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
shopt -u nullglob
# Glob order is the C-locale sort of NNNN-name.patch, i.e. application order.

pkg_installed() {
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true) == installed ]]
}

src_version() {
    pkg_installed "$SRC_PKG" || return 0
    dpkg-query -W -f='${Version}' "$SRC_PKG" 2>/dev/null || true
}

# sha256 of a manifest: one line per input, each with its own digest.
compute_key() {
    local ver=$1 f
    {
        printf 'package %s %s\n' "$SRC_PKG" "$ver"
        printf 'fragment %s\n' "$(sha256sum <"$FRAGMENT" | cut -d' ' -f1)"
        for f in "${PATCHES[@]}"; do
            printf 'patch %s %s\n' "$(basename "$f")" "$(sha256sum <"$f" | cut -d' ' -f1)"
        done
        printf 'script %s\n' "$(sha256sum <"$SELF" | cut -d' ' -f1)"
    } | sha256sum | cut -d' ' -f1
}

# Key of the prepared (extracted + patched) source tree and of its object
# directory: a config-only change reuses both, so the rebuild is incremental.
compute_srckey() {
    local ver=$1 f
    {
        printf 'layout %s\n' "$SRC_LAYOUT_VERSION"
        printf 'package %s %s\n' "$SRC_PKG" "$ver"
        for f in "${PATCHES[@]}"; do
            printf 'patch %s %s\n' "$(basename "$f")" "$(sha256sum <"$f" | cut -d' ' -f1)"
        done
    } | sha256sum | cut -d' ' -f1 | cut -c1-16
}

if ((print_key)); then
    ver=$(src_version)
    [[ -n $ver ]] || die "$SRC_PKG is not installed; the key depends on its version (run $0 to install it and build)"
    compute_key "$ver"
    exit 0
fi

# ---------------------------------------------------------- dependencies ---

ensure_deps() {
    local missing=() p
    for p in "${APT_DEPS[@]}"; do
        pkg_installed "$p" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    log "installing build dependencies: ${missing[*]}"
    [[ $(id -u) == 0 ]] || die "missing packages (${missing[*]}) and not root: install them with apt-get"
    command -v apt-get >/dev/null || die "apt-get not found; install: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
        log "apt-get install failed; running apt-get update and retrying"
        apt-get update >&2 || die "apt-get update failed"
        apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
            || die "apt-get install failed for: ${missing[*]}"
    fi
}

CACHE=${EMBER_CACHE:-/var/cache/ember}
CACHE=$(realpath -m -- "$CACHE")
BUILD=$CACHE/build

# A cache hit needs nothing but the key (and so only the source package's
# version): check before touching any other dependency.
VERSION=$(src_version)
if [[ -n $VERSION ]]; then
    KEY=$(compute_key "$VERSION")
    if [[ -f $CACHE/kernel/$KEY/vmlinux ]]; then
        log "guest kernel already built (key $KEY)"
        echo "$CACHE/kernel/$KEY"
        exit 0
    fi
fi

ensure_deps
[[ -f $SRC_TARBALL ]] || die "$SRC_PKG is installed but $SRC_TARBALL is missing"
VERSION=$(src_version)
[[ -n $VERSION ]] || die "cannot read the version of $SRC_PKG"

KEY=$(compute_key "$VERSION")
SRCKEY=$(compute_srckey "$VERSION")
OUT=$CACHE/kernel/$KEY

mkdir -p "$CACHE/kernel" "$BUILD" 2>/dev/null || die "cannot create $CACHE (set EMBER_CACHE to a writable directory)"

# One build per source tree at a time (they share the object directory).
exec 9>"$BUILD/$SRCKEY.lock" || die "cannot open lock file $BUILD/$SRCKEY.lock"
if ! flock -n 9; then
    log "another build of this source tree is running; waiting for it"
    flock 9 || die "cannot lock $BUILD/$SRCKEY.lock"
fi
if [[ -f $OUT/vmlinux ]]; then # built by whoever held the lock
    log "guest kernel already built (key $KEY)"
    echo "$OUT"
    exit 0
fi

TMP_DIRS=()
cleanup() {
    local d
    for d in "${TMP_DIRS[@]}"; do rm -rf -- "$d"; done
}
trap cleanup EXIT

start=$SECONDS
log "building guest kernel (key $KEY), this takes several minutes"

# ------------------------------------------------------------ source tree ---

SRC=$BUILD/src-$SRCKEY
if [[ ! -f $SRC/.ember-prepared ]]; then
    rm -rf -- "$SRC"
    tmp=$(mktemp -d "$BUILD/src-$SRCKEY.tmp.XXXXXX")
    TMP_DIRS+=("$tmp")
    log "extracting $SRC_TARBALL ($SRC_PKG $VERSION)"
    tar -xJf "$SRC_TARBALL" -C "$tmp" || die "extracting $SRC_TARBALL failed"
    [[ -d $tmp/$SRC_TOPDIR ]] || die "$SRC_TARBALL has no $SRC_TOPDIR/ directory"
    for p in "${PATCHES[@]}"; do
        log "applying $(basename "$p")"
        patch -d "$tmp/$SRC_TOPDIR" -p1 --forward --batch --quiet <"$p" >&2 \
            || die "patch $(basename "$p") does not apply to $SRC_PKG $VERSION"
    done
    touch "$tmp/$SRC_TOPDIR/.ember-prepared"
    mv -T -- "$tmp/$SRC_TOPDIR" "$SRC" || die "cannot move the source tree to $SRC"
fi

# -------------------------------------------------------------- configure ---

OBJ=$BUILD/obj-$SRCKEY
LOG=$OBJ/ember-build.log
# A build that died half way may leave truncated objects behind: start over.
if [[ -e $OBJ/.ember-building ]]; then
    log "previous build in $OBJ did not finish; starting from a clean object directory"
    rm -rf -- "$OBJ"
fi
mkdir -p "$OBJ"
: >"$LOG"

kmake() {
    nice -n 10 make -C "$SRC" O="$OBJ" ARCH=x86_64 "$@" >>"$LOG" 2>&1
}

fail_with_log() {
    log "last lines of $LOG:"
    tail -n 40 "$LOG" >&2 || true
    die "$1"
}

log "configuring (tinyconfig + config-fragment + olddefconfig); log: $LOG"
kmake tinyconfig || fail_with_log "make tinyconfig failed"
(cd "$OBJ" && "$SRC/scripts/kconfig/merge_config.sh" -m .config "$FRAGMENT" >>"$LOG" 2>&1) \
    || fail_with_log "merging config-fragment failed"
kmake olddefconfig || fail_with_log "make olddefconfig failed"

# Every assignment in the fragment must hold in the final .config: a symbol
# that Kconfig silently dropped (unmet dependency, renamed, select) fails here.
verify_config() {
    awk '
        FNR == NR {
            if (match($0, /^CONFIG_[A-Za-z0-9_]+=/)) {
                final[substr($0, 1, RLENGTH - 1)] = substr($0, RLENGTH + 1)
            }
            next
        }
        {
            sub(/[ \t]+$/, "")
        }
        /^CONFIG_[A-Za-z0-9_]+=/ || /^# CONFIG_[A-Za-z0-9_]+ is not set$/ {
            sym = ($1 == "#") ? $2 : substr($0, 1, index($0, "=") - 1)
            if (sym in seen) {
                printf "  %s: assigned more than once in config-fragment\n", sym; bad++
            }
            seen[sym] = 1
        }
        /^CONFIG_[A-Za-z0-9_]+=/ {
            eq = index($0, "=")
            sym = substr($0, 1, eq - 1); want = substr($0, eq + 1)
            if (!(sym in final)) {
                printf "  %s: want %s, not set in final config\n", sym, want; bad++
            } else if (final[sym] != want) {
                printf "  %s: want %s, got %s\n", sym, want, final[sym]; bad++
            }
            next
        }
        /^# CONFIG_[A-Za-z0-9_]+ is not set$/ {
            sym = $2
            if (sym in final) {
                printf "  %s: want off, got %s\n", sym, final[sym]; bad++
            }
            next
        }
        END { exit bad ? 1 : 0 }
    ' "$OBJ/.config" "$FRAGMENT" >&2
}
if ! verify_config; then
    die "the final kernel config does not match config-fragment (symbols above); fix the fragment"
fi

# What ember itself relies on, checked even if someone trims the fragment.
verify_required() {
    local sym bad=0 line
    for sym in "${REQUIRED_Y[@]}"; do
        line=$(grep -E "^CONFIG_${sym}=" "$OBJ/.config" || true)
        if [[ $line != "CONFIG_${sym}=y" ]]; then
            printf '  CONFIG_%s: required =y, got %s\n' "$sym" "${line:+${line#*=}}${line:-off}" >&2
            bad=1
        fi
    done
    for sym in "${REQUIRED_OFF[@]}"; do
        if grep -qE "^CONFIG_${sym}=" "$OBJ/.config"; then
            printf '  CONFIG_%s: required off, got %s\n' "$sym" \
                "$(grep -E "^CONFIG_${sym}=" "$OBJ/.config" | cut -d= -f2-)" >&2
            bad=1
        fi
    done
    line=$(grep -E '^CONFIG_SERIAL_8250_NR_UARTS=' "$OBJ/.config" || true)
    [[ $line == CONFIG_SERIAL_8250_NR_UARTS=1 ]] || { echo "  CONFIG_SERIAL_8250_NR_UARTS: required 1" >&2; bad=1; }
    line=$(grep -E '^CONFIG_SERIAL_8250_RUNTIME_UARTS=' "$OBJ/.config" || true)
    [[ $line == CONFIG_SERIAL_8250_RUNTIME_UARTS=1 ]] || { echo "  CONFIG_SERIAL_8250_RUNTIME_UARTS: required 1" >&2; bad=1; }
    return $bad
}
if ! verify_required; then
    die "the final kernel config lacks symbols ember requires (above)"
fi
log "config verified: every assignment in config-fragment holds, required symbols present"

# ------------------------------------------------------------------ build ---

jobs=$(nproc)
log "compiling vmlinux and bzImage (make -j$jobs, nice 10); log: $LOG"
touch "$OBJ/.ember-building"
kmake -j"$jobs" vmlinux bzImage || fail_with_log "kernel build failed"
rm -f -- "$OBJ/.ember-building"

for f in vmlinux arch/x86/boot/bzImage .config System.map; do
    [[ -s $OBJ/$f ]] || die "build finished but $OBJ/$f is missing"
done

# ---------------------------------------------------------------- install ---

stage=$(mktemp -d "$CACHE/kernel/.$KEY.tmp.XXXXXX")
TMP_DIRS+=("$stage")
cp -- "$OBJ/vmlinux" "$stage/vmlinux"
cp -- "$OBJ/arch/x86/boot/bzImage" "$stage/bzImage"
cp -- "$OBJ/.config" "$stage/config"
cp -- "$OBJ/System.map" "$stage/System.map"
chmod 0755 "$stage"
chmod 0644 "$stage"/*
sync -f "$stage/vmlinux" 2>/dev/null || true
# A directory without vmlinux is debris from an interrupted install.
if [[ -e $OUT && ! -f $OUT/vmlinux ]]; then
    rm -rf -- "$OUT"
fi
if ! mv -T -- "$stage" "$OUT" 2>/dev/null; then
    [[ -f $OUT/vmlinux ]] || die "cannot install into $OUT"
fi

log "guest kernel built in $((SECONDS - start)) s: $OUT"
echo "$OUT"

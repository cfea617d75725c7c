//! The dashboard's vendored front-end files (`docs/architecture.md`, "The dashboard's
//! vendored assets"): xterm.js and its fit addon come from the npm registry at build time,
//! pinned by `ui/npm/package-lock.json`, and are embedded in the binary (`src/ui/mod.rs`
//! includes them from `OUT_DIR/vendor/`); nothing is fetched when the server runs.
//!
//! `npm ci --ignore-scripts` runs once per lockfile: into `$EMBER_CACHE/npm/<hash>` (or
//! `OUT_DIR/npm/<hash>` without `EMBER_CACHE`), keyed by a hash of the lockfile, and only
//! when that directory is missing. Cargo reruns this script only when the lockfile, the
//! manifest or this file changed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (path under `node_modules`, name in `OUT_DIR/vendor`).
const FILES: &[(&str, &str)] = &[
    ("@xterm/xterm/lib/xterm.js", "xterm.js"),
    ("@xterm/xterm/css/xterm.css", "xterm.css"),
    ("@xterm/addon-fit/lib/addon-fit.js", "addon-fit.js"),
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let npm_dir = manifest.join("ui/npm");
    let lock = npm_dir.join("package-lock.json");
    let pkg = npm_dir.join("package.json");
    println!("cargo:rerun-if-changed={}", lock.display());
    println!("cargo:rerun-if-changed={}", pkg.display());
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=EMBER_CACHE");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));

    let lock_bytes =
        std::fs::read(&lock).unwrap_or_else(|e| panic!("reading {}: {e}", lock.display()));
    let pkg_bytes =
        std::fs::read(&pkg).unwrap_or_else(|e| panic!("reading {}: {e}", pkg.display()));
    let key = format!(
        "{:016x}",
        fnv1a(&[&lock_bytes[..], &pkg_bytes[..]].concat())
    );
    let cache_root = match std::env::var_os("EMBER_CACHE") {
        Some(c) if !c.is_empty() => PathBuf::from(c).join("npm"),
        _ => out.join("npm"),
    };
    let cache = cache_root.join(&key);
    if !FILES
        .iter()
        .all(|(p, _)| cache.join("node_modules").join(p).is_file())
    {
        install(&cache_root, &cache, &lock_bytes, &pkg_bytes);
    }
    let vendor = out.join("vendor");
    std::fs::create_dir_all(&vendor).expect("creating OUT_DIR/vendor");
    for (from, to) in FILES {
        let src = cache.join("node_modules").join(from);
        std::fs::copy(&src, vendor.join(to))
            .unwrap_or_else(|e| panic!("copying {}: {e}", src.display()));
    }
}

/// `npm ci --ignore-scripts` into a scratch directory, then renamed to `cache` (so that two
/// builds at once never see a half-installed tree).
fn install(root: &Path, cache: &Path, lock: &[u8], pkg: &[u8]) {
    let scratch = root.join(format!(
        ".tmp-{}-{}",
        std::process::id(),
        cache.file_name().and_then(|n| n.to_str()).unwrap_or("x")
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)
        .unwrap_or_else(|e| panic!("creating {}: {e}", scratch.display()));
    std::fs::write(scratch.join("package-lock.json"), lock).expect("writing the lockfile");
    std::fs::write(scratch.join("package.json"), pkg).expect("writing package.json");
    let status = Command::new("npm")
        .args([
            "ci",
            "--ignore-scripts",
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
        ])
        .current_dir(&scratch)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!(
            "`npm ci` for the dashboard's vendored files (server/ui/npm) failed ({s}); \
             it needs the npm registry once per lockfile"
        ),
        Err(e) => panic!(
            "cannot run `npm` ({e}): building ember-server needs Node.js and npm \
             (Debian: apt-get install nodejs npm) to fetch the dashboard's xterm.js \
             pinned by server/ui/npm/package-lock.json"
        ),
    }
    if std::fs::rename(&scratch, cache).is_err() {
        // Another build got there first: use its tree.
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

/// FNV-1a, 64 bits: the cache key (no dependency for a build script).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

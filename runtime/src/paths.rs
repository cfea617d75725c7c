//! Where ember keeps things on the host.
//!
//! - `$EMBER_CACHE` (default `/var/cache/ember`): derived, content-addressed artifacts that can
//!   be rebuilt from the repository — guest kernels, root filesystems, template snapshots.
//! - `$EMBER_HOME` (default `/var/lib/ember`): state — sandboxes' working directories (and,
//!   later, the durable store).

use std::path::PathBuf;

/// The artifact cache (`$EMBER_CACHE`, default `/var/cache/ember`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("EMBER_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/ember"))
}

/// ember's state directory (`$EMBER_HOME`, default `/var/lib/ember`).
pub fn home_dir() -> PathBuf {
    std::env::var_os("EMBER_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/ember"))
}

/// Where built templates live: `<cache>/templates`.
pub fn templates_dir() -> PathBuf {
    cache_dir().join("templates")
}

/// Where running sandboxes keep their per-VM files: `<home>/run`.
pub fn run_dir() -> PathBuf {
    home_dir().join("run")
}

/// A random 16-hex-digit id (64 bits from the kernel's RNG): globally unique in practice,
/// never a per-host counter.
pub fn random_id() -> String {
    let mut b = [0u8; 8];
    // getrandom(2) never fails for 8 bytes once the RNG is initialised; fall back to the clock
    // and pid if it somehow does, so an id is always produced.
    // SAFETY: the buffer is valid for 8 writable bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        b = (t ^ ((std::process::id() as u64) << 40)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_and_differ() {
        let a = random_id();
        let b = random_id();
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}

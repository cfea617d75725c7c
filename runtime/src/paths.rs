//! Where ember keeps things on the host.
//!
//! - `$EMBER_CACHE` (default `/var/cache/ember`): derived, content-addressed artifacts that can
//!   be rebuilt from the repository — guest kernels, root filesystems, template snapshots.
//! - `$EMBER_HOME` (default `/var/lib/ember`): state — sandboxes' working directories (and,
//!   later, the durable store).

use std::path::{Path, PathBuf};

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

/// Makes ember's state readable by the server alone, and says what it had to repair: `home`
/// becomes mode 0700 (everything under it — artifacts, snapshots, sandboxes' disks and pause
/// memory, jails — is then out of other accounts' reach whatever its own mode; a jailed VMM
/// reaches its files from inside its jail, where the path above is not walked), and each of
/// `files` that exists (the database, its WAL and shared-memory files, the token) mode 0600.
/// Only modes are changed; a state directory another account owns is left to its owner.
pub fn secure_state(home: &Path, files: &[PathBuf]) -> std::io::Result<Vec<String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut repaired = Vec::new();
    let mut fix = |p: &Path, want: u32| -> std::io::Result<()> {
        let md = match std::fs::symlink_metadata(p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if md.file_type().is_symlink() || (md.uid() != me && me != 0) {
            return Ok(());
        }
        let mode = md.mode() & 0o7777;
        if mode & 0o077 != 0 {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(want))?;
            repaired.push(format!("{} was mode {mode:o}, now {want:o}", p.display()));
        }
        Ok(())
    };
    fix(home, 0o700)?;
    for f in files {
        fix(f, 0o600)?;
    }
    Ok(repaired)
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

/// The marker file of a filesystem-only snapshot directory, one without memory or VM state
/// (`lifecycle/boot.rs`).
pub const FS_ONLY: &str = "ember-fs-only.json";

/// Whether `dir` holds a filesystem-only snapshot (its sandboxes boot rather than restore).
pub fn is_fs_only(dir: &Path) -> bool {
    dir.join(FS_ONLY).is_file()
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

    #[test]
    fn state_is_made_private_and_repairs_are_named() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("ember-secure-{}", random_id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let db = d.join("ember.db");
        std::fs::write(&db, b"x").unwrap();
        std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
        let private = d.join("token");
        std::fs::write(&private, b"t").unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        let files = [db.clone(), private.clone(), d.join("absent-wal")];
        let fixed = secure_state(&d, &files).unwrap();
        assert_eq!(fixed.len(), 2, "{fixed:?}");
        assert!(fixed[0].contains("was mode 755, now 700"), "{fixed:?}");
        assert!(
            fixed[1].contains("ember.db was mode 644, now 600"),
            "{fixed:?}"
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&d), mode(&db), mode(&private)), (0o700, 0o600, 0o600));
        assert!(secure_state(&d, &files).unwrap().is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}

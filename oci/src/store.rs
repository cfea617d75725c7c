//! The local blob store: `DIR/blobs/sha256/<hex>`, written through a hasher into a temporary
//! file and renamed into place only when the digest matches, so a blob in the store is always
//! the content its name says.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::spec::Digest;
use crate::{io_err, OciError};

/// A content-addressed blob directory.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    /// A store in `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> BlobStore {
        BlobStore { dir: dir.into() }
    }

    /// Where the blob `d` lives (whether or not it is there).
    pub fn path(&self, d: &Digest) -> PathBuf {
        self.dir.join("blobs/sha256").join(d.hex())
    }

    /// Whether the blob is in the store.
    pub fn has(&self, d: &Digest) -> bool {
        self.path(d).is_file()
    }

    /// Reads a small blob (a document) fully.
    pub fn read(&self, d: &Digest) -> Result<Vec<u8>, OciError> {
        let p = self.path(d);
        std::fs::read(&p).map_err(io_err("cannot read blob", p))
    }

    /// Copies `reader` into the store as blob `expected`, refusing more than `max` bytes and a
    /// digest mismatch (the temporary file is removed then). Returns the size.
    pub fn put(
        &self,
        what: &str,
        expected: &Digest,
        reader: &mut dyn Read,
        max: u64,
    ) -> Result<u64, OciError> {
        let (mut tmp, actual, n) = self.take_in(what, reader, max)?;
        if &actual != expected {
            return Err(OciError::DigestMismatch {
                what: what.into(),
                expected: expected.to_string(),
                actual: actual.to_string(),
            });
        }
        tmp.1.sync_all().map_err(io_err("cannot sync", &tmp.0))?;
        self.publish(&mut tmp, &actual)?;
        Ok(n)
    }

    /// Copies `reader` into the store under the digest of what it holds (at most `max` bytes).
    pub fn put_computed(
        &self,
        what: &str,
        reader: &mut dyn Read,
        max: u64,
    ) -> Result<Digest, OciError> {
        let (mut tmp, d, _) = self.take_in(what, reader, max)?;
        self.publish(&mut tmp, &d)?;
        Ok(d)
    }

    /// Copies `reader` (at most `max` bytes) into a temporary file of the store through a
    /// hasher: the file, the digest of its content and its size.
    fn take_in(
        &self,
        what: &str,
        reader: &mut dyn Read,
        max: u64,
    ) -> Result<(TempFile, Digest, u64), OciError> {
        let dir = self.dir.join("blobs/sha256");
        std::fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        let mut tmp = tempfile_in(&dir)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut n_total = 0u64;
        loop {
            let n = reader
                .read(&mut buf)
                .map_err(io_err("cannot read", what.to_string()))?;
            if n == 0 {
                break;
            }
            n_total += n as u64;
            if n_total > max {
                return Err(OciError::TooLarge {
                    layer: what.into(),
                    message: format!("more than {max} bytes (the cap for one blob)"),
                });
            }
            h.update(&buf[..n]);
            tmp.1
                .write_all(&buf[..n])
                .map_err(io_err("cannot write", &tmp.0))?;
        }
        Ok((tmp, Digest::from_hasher(h), n_total))
    }

    /// Renames the temporary file into place as blob `d` (it is then kept).
    fn publish(&self, tmp: &mut TempFile, d: &Digest) -> Result<(), OciError> {
        let final_path = self.path(d);
        std::fs::rename(&tmp.0, &final_path)
            .map_err(io_err("cannot rename into place", &final_path))?;
        tmp.0 = PathBuf::new();
        Ok(())
    }

    /// Copies the file at `src` in as blob `expected` (verified), unless it is there already.
    pub fn put_file(
        &self,
        what: &str,
        expected: &Digest,
        src: &Path,
        max: u64,
    ) -> Result<u64, OciError> {
        if self.has(expected) {
            return std::fs::metadata(self.path(expected))
                .map(|m| m.len())
                .map_err(io_err("cannot stat", src));
        }
        let mut f = File::open(src).map_err(io_err("cannot open", src))?;
        self.put(what, expected, &mut f, max)
    }
}

/// A temporary file in `dir`, removed on drop unless its path was cleared.
struct TempFile(PathBuf, File);

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn tempfile_in(dir: &Path) -> Result<TempFile, OciError> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = dir.join(format!(".tmp-put-{}-{n}", std::process::id()));
    let f = File::create(&p).map_err(io_err("cannot create", &p))?;
    Ok(TempFile(p, f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blob_is_kept_only_when_its_digest_matches() {
        let dir = tempfile::tempdir().unwrap();
        let s = BlobStore::new(dir.path());
        let d = Digest::of(b"hello");
        assert_eq!(s.put("b", &d, &mut &b"hello"[..], 100).unwrap(), 5);
        assert_eq!(s.read(&d).unwrap(), b"hello");
        let other = Digest::of(b"other");
        let e = s
            .put("blob other", &other, &mut &b"hello"[..], 100)
            .unwrap_err();
        assert!(matches!(e, OciError::DigestMismatch { .. }), "{e}");
        assert!(!s.has(&other));
        let e = s.put("big", &other, &mut &b"other"[..], 3).unwrap_err();
        assert!(e.to_string().contains("more than 3 bytes"), "{e}");
        // No temporary file left behind.
        assert_eq!(
            std::fs::read_dir(dir.path().join("blobs/sha256"))
                .unwrap()
                .count(),
            1
        );
    }
}

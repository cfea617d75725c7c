//! The volume file protocol: how the guest's FUSE client (`volume_fuse.rs`) asks the host's
//! file server (`runtime/src/volumes/`) for a volume's files. See `docs/volumes.md`.
//!
//! The guest connects to the host (vsock CID 2, port [`VOLUME_PORT`]); the VMM turns that into a
//! connection to the Unix socket `<vsock uds>_<port>`, where the runtime listens for that one
//! sandbox. One connection per mount. The first request is [`Request::Hello`] naming the volume;
//! the host answers only for volumes mounted into that sandbox.
//!
//! Every message, either way, is one frame:
//!
//! ```text
//! +-------------------+-----------------+-------------------+-------------+
//! | u32 LE header len | u32 LE data len | header (JSON)     | data (raw)  |
//! +-------------------+-----------------+-------------------+-------------+
//! ```
//!
//! A header is at most [`MAX_HEADER`] bytes and data at most [`MAX_DATA`]; a peer that sends more
//! is cut off. Requests are answered in order, one reply each: a [`Reply`] header (an `errno` of 0
//! and a `body`, or a positive errno) and data for `read`.
//!
//! The protocol is path-based: paths are relative to the volume root, `/`-separated, with no
//! empty, `.` or `..` component. The host keeps no state but open write handles (`fh`), which a
//! dropped connection discards.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// The host vsock port the guest connects to.
pub const VOLUME_PORT: u32 = 1030;
/// Largest header accepted (a directory listing travels as data, not here).
pub const MAX_HEADER: usize = 64 * 1024;
/// Largest data part accepted (a read or write chunk; a listing).
pub const MAX_DATA: usize = 8 * 1024 * 1024;

/// A guest's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// First request: the volume this connection serves.
    Hello { volume: String },
    /// Attributes of `path` (of the open write handle `fh`, when given).
    Stat { path: String, fh: Option<u64> },
    /// A directory's entries: data is a JSON array of [`Entry`].
    List { path: String },
    /// Up to `len` bytes at `off` (from the write handle `fh` when given); data is the bytes.
    Read {
        path: String,
        fh: Option<u64>,
        off: u64,
        len: u32,
    },
    /// Opens `path` for writing: a staging copy (empty with `trunc`) that `flush` publishes.
    Open {
        path: String,
        create: bool,
        excl: bool,
        trunc: bool,
        mode: u32,
    },
    /// Writes the data at `off` into write handle `fh`.
    Write { fh: u64, off: u64 },
    /// Sets the size of `path` (or of write handle `fh`).
    SetSize {
        path: String,
        fh: Option<u64>,
        size: u64,
    },
    /// Publishes what was written through `fh` (an atomic rename over the file).
    Flush { fh: u64 },
    /// Publishes (if anything is unpublished) and forgets `fh`.
    Release { fh: u64 },
    /// Makes directory `path`.
    Mkdir { path: String, mode: u32 },
    /// Removes file `path`.
    Unlink { path: String },
    /// Removes empty directory `path`.
    Rmdir { path: String },
    /// Renames `from` to `to` (refused if `to` exists and `noreplace`).
    Rename {
        from: String,
        to: String,
        noreplace: bool,
    },
    /// The volume's cap and usage.
    Statfs,
}

/// A file's attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub dir: bool,
    pub size: u64,
    pub mode: u32,
    pub mtime_ns: i64,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub dir: bool,
}

/// The answer to [`Request::Open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Opened {
    pub fh: u64,
    pub attr: Attr,
}

/// The answer to [`Request::Hello`] and [`Request::Statfs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeState {
    pub read_only: bool,
    pub cap_bytes: u64,
    pub used_bytes: u64,
}

/// A reply header: `errno` 0 and a body, or an errno (positive) and no body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub errno: i32,
    #[serde(default)]
    pub body: serde_json::Value,
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, header: &[u8], data: &[u8]) -> io::Result<()> {
    let mut head = Vec::with_capacity(8 + header.len());
    head.extend_from_slice(&(header.len() as u32).to_le_bytes());
    head.extend_from_slice(&(data.len() as u32).to_le_bytes());
    head.extend_from_slice(header);
    if data.len() <= 64 * 1024 {
        head.extend_from_slice(data);
        w.write_all(&head)?;
    } else {
        w.write_all(&head)?;
        w.write_all(data)?;
    }
    w.flush()
}

/// Reads one frame: (header, data). End of stream before a frame is `UnexpectedEof`.
pub fn read_frame(r: &mut impl Read) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut lens = [0u8; 8];
    r.read_exact(&mut lens)?;
    let hl = u32::from_le_bytes(lens[..4].try_into().unwrap_or_default()) as usize;
    let dl = u32::from_le_bytes(lens[4..].try_into().unwrap_or_default()) as usize;
    if hl > MAX_HEADER || dl > MAX_DATA {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("volume frame too large (header {hl}, data {dl})"),
        ));
    }
    let mut header = vec![0u8; hl];
    r.read_exact(&mut header)?;
    let mut data = vec![0u8; dl];
    r.read_exact(&mut data)?;
    Ok((header, data))
}

/// Checks a protocol path: relative, `/`-separated, no empty/`.`/`..` component, no NUL,
/// at most 4096 bytes and 255 per component. `""` is the root.
pub fn check_path(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Ok(());
    }
    if path.len() > 4096 {
        return Err("path longer than 4096 bytes".into());
    }
    if path.contains('\0') {
        return Err("path contains a NUL byte".into());
    }
    for c in path.split('/') {
        match c {
            "" => return Err(format!("path {path:?} has an empty component")),
            "." | ".." => return Err(format!("path {path:?} has a {c:?} component")),
            c if c.len() > 255 => return Err("path component longer than 255 bytes".into()),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_refuse_oversize() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"{\"op\":\"statfs\"}", b"abc").unwrap();
        let (h, d) = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(h, b"{\"op\":\"statfs\"}");
        assert_eq!(d, b"abc");
        let mut big = Vec::new();
        big.extend_from_slice(&(MAX_HEADER as u32 + 1).to_le_bytes());
        big.extend_from_slice(&0u32.to_le_bytes());
        assert!(read_frame(&mut big.as_slice()).is_err());
    }

    #[test]
    fn paths_are_checked() {
        assert!(check_path("").is_ok());
        assert!(check_path("a/b.txt").is_ok());
        for bad in ["/a", "a/", "a//b", "../x", "a/./b", "a/../../etc", "a\0b"] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn requests_serialize_with_an_op_tag() {
        let r: Request = serde_json::from_str(r#"{"op":"hello","volume":"v"}"#).unwrap();
        assert_eq!(r, Request::Hello { volume: "v".into() });
        assert!(serde_json::from_str::<Request>(r#"{"op":"nope"}"#).is_err());
    }
}

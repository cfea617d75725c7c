//! Versioned, checksummed state files.
//!
//! A state file holds one serde value (the VMM's `VmState`, say). Every integer is little endian:
//!
//! | offset          | size       | field                                                      |
//! |-----------------|------------|------------------------------------------------------------|
//! | 0               | 8          | magic, the ASCII bytes `EMBERSNP` ([`STATE_MAGIC`])        |
//! | 8               | 4          | `format_version: u32` ([`FORMAT_VERSION`])                 |
//! | 12              | 8          | `body_len: u64`                                            |
//! | 20              | `body_len` | body: the value encoded with bincode 1.3 (see below)       |
//! | 20 + `body_len` | 8          | `crc64: u64`, CRC-64/XZ over every preceding byte           |
//!
//! The body uses bincode 1.3 with fixed-width integers, little endian, and no trailing bytes
//! allowed (the same encoding as `bincode::serialize`). Types whose `Deserialize` relies on
//! `deserialize_any` (untagged enums, `serde_json::Value`, internally tagged enums) cannot be
//! stored; bincode refuses them.
//!
//! The checksum is CRC-64/XZ ([`crc::CRC_64_XZ`]: polynomial 0x42F0E1EBA9EA3693, reflected,
//! init and xorout all ones), the CRC used by xz; it detects every single-bit and every burst
//! error up to 64 bits.
//!
//! Reading checks, in this order, and stops at the first failure:
//! 1. the input holds at least a header and a checksum ([`StateError::Truncated`]);
//! 2. the magic ([`StateError::BadMagic`]);
//! 3. the format version is one this build reads ([`StateError::UnsupportedVersion`]);
//! 4. `body_len` matches the input length ([`StateError::Truncated`] when the input is shorter,
//!    [`StateError::TrailingData`] when longer);
//! 5. the checksum ([`StateError::ChecksumMismatch`]);
//! 6. the body decodes as the requested type, consuming it exactly, with bincode's allocation
//!    limit set to `body_len` so a hostile length prefix inside the body cannot make it allocate
//!    more than the file holds ([`StateError::Corrupt`]).
//!
//! Nothing is built from a state file that fails any check.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use bincode::Options;
use crc::{Crc, Table};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::fsutil;

/// The first eight bytes of every state file.
pub const STATE_MAGIC: [u8; 8] = *b"EMBERSNP";

/// The format version this build writes, and the newest it reads. 2: the vsock device keeps
/// its established connections (format-1 files are still read: their vsock state is a
/// variant of its own).
pub const FORMAT_VERSION: u32 = 2;

/// The oldest format version this build still reads.
pub const MIN_FORMAT_VERSION: u32 = 1;

/// Length of the fixed header: magic, format version, body length.
pub const HEADER_LEN: usize = 8 + 4 + 8;

/// Length of the trailing checksum.
pub const TRAILER_LEN: usize = 8;

/// Smallest possible state file: a header, an empty body and the checksum.
pub const MIN_STATE_LEN: usize = HEADER_LEN + TRAILER_LEN;

/// The checksum: CRC-64/XZ, table-driven (slice-by-16).
const CRC64: Crc<u64, Table<16>> = Crc::<u64, Table<16>>::new(&crc::CRC_64_XZ);

/// Where state bytes came from, so errors can name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Bytes handed to [`encode_state`] / [`decode_state`] / [`verify_state`].
    Buffer,
    /// A file read or written by [`read_state`] / [`write_state`] / [`verify_state_file`].
    File(PathBuf),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Buffer => f.write_str("snapshot state buffer"),
            Origin::File(path) => write!(f, "snapshot state file {}", path.display()),
        }
    }
}

/// Why a state file could not be written, read or accepted.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A filesystem operation failed.
    #[error("{origin}: cannot {op}: {source}")]
    Io {
        /// The file involved.
        origin: Origin,
        /// What was being done, e.g. "read the file".
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The value could not be encoded (e.g. a sequence without a known length).
    #[error("{origin}: cannot encode the state: {source}")]
    Encode {
        /// The file (or buffer) being written.
        origin: Origin,
        /// The encoder's complaint.
        source: bincode::Error,
    },
    /// The input is shorter than its header says, or shorter than a header.
    #[error("{origin}: truncated: {len} bytes, but {needed} are needed")]
    Truncated {
        /// Where the bytes came from.
        origin: Origin,
        /// Bytes present.
        len: u64,
        /// Bytes a complete file needs (saturated at `u64::MAX` for absurd `body_len`s).
        needed: u64,
    },
    /// The input does not start with [`STATE_MAGIC`].
    #[error(
        "{origin}: not an ember snapshot state file: magic is \"{}\", expected \"EMBERSNP\"",
        found.escape_ascii()
    )]
    BadMagic {
        /// Where the bytes came from.
        origin: Origin,
        /// The first eight bytes found.
        found: [u8; 8],
    },
    /// The format version is newer than this build, or older than it still reads.
    #[error(
        "{origin}: format version {found} is not supported: this build reads versions \
         {MIN_FORMAT_VERSION} to {supported}"
    )]
    UnsupportedVersion {
        /// Where the bytes came from.
        origin: Origin,
        /// The version in the file.
        found: u32,
        /// The newest version this build reads ([`FORMAT_VERSION`]).
        supported: u32,
    },
    /// Bytes follow the checksum.
    #[error("{origin}: {extra} unexpected bytes after the checksum (body_len is {body_len})")]
    TrailingData {
        /// Where the bytes came from.
        origin: Origin,
        /// The body length recorded in the header.
        body_len: u64,
        /// How many bytes follow the checksum.
        extra: u64,
    },
    /// The stored checksum does not match the contents.
    #[error("{origin}: checksum mismatch: stored {expected:#018x}, computed {found:#018x}")]
    ChecksumMismatch {
        /// Where the bytes came from.
        origin: Origin,
        /// The CRC stored in the file.
        expected: u64,
        /// The CRC computed over the contents.
        found: u64,
    },
    /// The checksum is right but the body does not decode as the requested type.
    #[error("{origin}: the state body does not decode as {type_name}: {source}")]
    Corrupt {
        /// Where the bytes came from.
        origin: Origin,
        /// The Rust type that was requested.
        type_name: &'static str,
        /// The decoder's complaint.
        source: bincode::Error,
    },
}

impl StateError {
    /// Where the offending bytes came from (a file path or an in-memory buffer).
    pub fn origin(&self) -> &Origin {
        match self {
            StateError::Io { origin, .. }
            | StateError::Encode { origin, .. }
            | StateError::Truncated { origin, .. }
            | StateError::BadMagic { origin, .. }
            | StateError::UnsupportedVersion { origin, .. }
            | StateError::TrailingData { origin, .. }
            | StateError::ChecksumMismatch { origin, .. }
            | StateError::Corrupt { origin, .. } => origin,
        }
    }

    fn with_origin(mut self, new: Origin) -> Self {
        match &mut self {
            StateError::Io { origin, .. }
            | StateError::Encode { origin, .. }
            | StateError::Truncated { origin, .. }
            | StateError::BadMagic { origin, .. }
            | StateError::UnsupportedVersion { origin, .. }
            | StateError::TrailingData { origin, .. }
            | StateError::ChecksumMismatch { origin, .. }
            | StateError::Corrupt { origin, .. } => *origin = new,
        }
        self
    }
}

/// What the header and trailer of a valid state file say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateInfo {
    /// The format version.
    pub format_version: u32,
    /// The body length in bytes.
    pub body_len: u64,
    /// The CRC-64/XZ stored in (and verified against) the file.
    pub crc64: u64,
}

/// The bincode configuration of the body. Writing and reading must agree.
fn body_options() -> impl Options + Copy {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .reject_trailing_bytes()
}

/// Encode `value` as a complete state file image (header, body, checksum).
///
/// # Errors
/// [`StateError::Encode`] if bincode cannot encode the value.
pub fn encode_state<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, StateError> {
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(&STATE_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes()); // body_len, patched below
    body_options()
        .serialize_into(&mut out, value)
        .map_err(|source| StateError::Encode {
            origin: Origin::Buffer,
            source,
        })?;
    let body_len = (out.len() - HEADER_LEN) as u64;
    out[12..HEADER_LEN].copy_from_slice(&body_len.to_le_bytes());
    let crc = CRC64.checksum(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Check a state file image and decode its body as `T`. See the module docs for the order of
/// the checks.
///
/// # Errors
/// Any [`StateError`] but `Io` and `Encode`, with [`Origin::Buffer`].
pub fn decode_state<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StateError> {
    decode_from(bytes, &Origin::Buffer)
}

/// Check a state file image (framing, version and checksum) without decoding the body.
///
/// # Errors
/// Any of `Truncated`, `BadMagic`, `UnsupportedVersion`, `TrailingData`, `ChecksumMismatch`.
pub fn verify_state(bytes: &[u8]) -> Result<StateInfo, StateError> {
    check_frame(bytes, &Origin::Buffer).map(|(info, _)| info)
}

/// Encode `value` and write it to `path` atomically and durably: the image goes to a temporary
/// sibling, is fsynced, renamed over `path`, and the directory is fsynced. A crash leaves either
/// the previous file or the complete new one.
///
/// # Errors
/// [`StateError::Encode`], or [`StateError::Io`] naming the step that failed.
pub fn write_state<T: Serialize + ?Sized>(
    path: impl AsRef<Path>,
    value: &T,
) -> Result<(), StateError> {
    let path = path.as_ref();
    let origin = || Origin::File(path.to_path_buf());
    let bytes = encode_state(value).map_err(|e| e.with_origin(origin()))?;
    fsutil::atomic_write(path, &bytes).map_err(|(op, source)| StateError::Io {
        origin: origin(),
        op,
        source,
    })
}

/// Read the state file at `path`, check it and decode its body as `T`.
///
/// # Errors
/// [`StateError::Io`] if the file cannot be read, otherwise the check failures listed in the
/// module docs, each naming `path`.
pub fn read_state<T: DeserializeOwned>(path: impl AsRef<Path>) -> Result<T, StateError> {
    let path = path.as_ref();
    let origin = Origin::File(path.to_path_buf());
    let bytes = read_file(path, &origin)?;
    decode_from(&bytes, &origin)
}

/// Read the state file at `path` and check its framing, version and checksum without decoding
/// the body (for tools that list or validate snapshots).
///
/// # Errors
/// As [`read_state`], except `Corrupt`.
pub fn verify_state_file(path: impl AsRef<Path>) -> Result<StateInfo, StateError> {
    let path = path.as_ref();
    let origin = Origin::File(path.to_path_buf());
    let bytes = read_file(path, &origin)?;
    check_frame(&bytes, &origin).map(|(info, _)| info)
}

fn read_file(path: &Path, origin: &Origin) -> Result<Vec<u8>, StateError> {
    fs::read(path).map_err(|source| StateError::Io {
        origin: origin.clone(),
        op: "read the file",
        source,
    })
}

fn decode_from<T: DeserializeOwned>(bytes: &[u8], origin: &Origin) -> Result<T, StateError> {
    let (info, body) = check_frame(bytes, origin)?;
    body_options()
        .with_limit(info.body_len)
        .deserialize(body)
        .map_err(|source| StateError::Corrupt {
            origin: origin.clone(),
            type_name: std::any::type_name::<T>(),
            source,
        })
}

/// Read a little-endian integer of `N` bytes at `at`; `None` if out of range.
fn le_bytes<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at.checked_add(N)?)?.try_into().ok()
}

/// Steps 1–5 of the module docs. Returns the header info and the body slice.
fn check_frame<'a>(bytes: &'a [u8], origin: &Origin) -> Result<(StateInfo, &'a [u8]), StateError> {
    let len = bytes.len() as u64;
    let truncated = |needed: u64| StateError::Truncated {
        origin: origin.clone(),
        len,
        needed,
    };

    // 1. Room for a header and a checksum.
    if bytes.len() < MIN_STATE_LEN {
        return Err(truncated(MIN_STATE_LEN as u64));
    }
    let (Some(magic), Some(version), Some(body_len)) = (
        le_bytes::<8>(bytes, 0),
        le_bytes::<4>(bytes, 8),
        le_bytes::<8>(bytes, 12),
    ) else {
        return Err(truncated(MIN_STATE_LEN as u64));
    };

    // 2. Magic.
    if magic != STATE_MAGIC {
        return Err(StateError::BadMagic {
            origin: origin.clone(),
            found: magic,
        });
    }

    // 3. Version.
    let format_version = u32::from_le_bytes(version);
    if !(MIN_FORMAT_VERSION..=FORMAT_VERSION).contains(&format_version) {
        return Err(StateError::UnsupportedVersion {
            origin: origin.clone(),
            found: format_version,
            supported: FORMAT_VERSION,
        });
    }

    // 4. Length consistency, with overflow-proof arithmetic for hostile body_len values.
    let body_len = u64::from_le_bytes(body_len);
    let needed = body_len.saturating_add(MIN_STATE_LEN as u64);
    if len < needed {
        return Err(truncated(needed));
    }
    if len > needed {
        return Err(StateError::TrailingData {
            origin: origin.clone(),
            body_len,
            extra: len - needed,
        });
    }

    // 5. Checksum. `len == needed` here, so the slicing below is in range; stay panic-free anyway.
    let crc_at = bytes.len() - TRAILER_LEN;
    let (Some(covered), Some(stored)) = (bytes.get(..crc_at), le_bytes::<8>(bytes, crc_at)) else {
        return Err(truncated(needed));
    };
    let expected = u64::from_le_bytes(stored);
    let found = CRC64.checksum(covered);
    if expected != found {
        return Err(StateError::ChecksumMismatch {
            origin: origin.clone(),
            expected,
            found,
        });
    }

    let body = covered.get(HEADER_LEN..).unwrap_or_default();
    Ok((
        StateInfo {
            format_version,
            body_len,
            crc64: expected,
        },
        body,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct DeviceState {
        name: String,
        regs: Vec<u32>,
        irq: Option<u8>,
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct VmState {
        mem_mib: u64,
        devices: Vec<DeviceState>,
        tags: BTreeMap<String, i64>,
        blob: Vec<u8>,
    }

    fn sample() -> VmState {
        VmState {
            mem_mib: 256,
            devices: vec![
                DeviceState {
                    name: "serial".into(),
                    regs: vec![1, 2, 3],
                    irq: Some(4),
                },
                DeviceState {
                    name: "virtio-blk".into(),
                    regs: vec![],
                    irq: None,
                },
            ],
            tags: [("a".to_string(), -1), ("b".to_string(), 2)].into(),
            blob: (0..200u8).collect(),
        }
    }

    /// Frame an arbitrary body with a valid header and checksum.
    fn frame(version: u32, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(body);
        let crc = CRC64.checksum(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn layout_is_as_documented() {
        let bytes = encode_state(&0x0102_0304u32).expect("encode");
        assert_eq!(&bytes[..8], b"EMBERSNP");
        assert_eq!(&bytes[8..12], &FORMAT_VERSION.to_le_bytes());
        assert_eq!(&bytes[12..20], &4u64.to_le_bytes());
        assert_eq!(&bytes[20..24], &[4, 3, 2, 1]);
        let crc = crc::Crc::<u64>::new(&crc::CRC_64_XZ).checksum(&bytes[..24]);
        assert_eq!(&bytes[24..], &crc.to_le_bytes());
        assert_eq!(bytes, frame(FORMAT_VERSION, &[4, 3, 2, 1]));
        let info = verify_state(&bytes).expect("valid");
        assert_eq!(
            info,
            StateInfo {
                format_version: FORMAT_VERSION,
                body_len: 4,
                crc64: crc
            }
        );
    }

    #[test]
    fn crc_is_crc64_xz() {
        // The catalogue check value of CRC-64/XZ.
        assert_eq!(CRC64.checksum(b"123456789"), 0x995D_C9BB_DF19_39FA);
    }

    #[test]
    fn round_trip_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state");
        let value = sample();
        write_state(&path, &value).expect("write");
        let back: VmState = read_state(&path).expect("read");
        assert_eq!(back, value);
        let info = verify_state_file(&path).expect("verify");
        assert_eq!(info.format_version, FORMAT_VERSION);
        // Overwriting works and is atomic (no temp files left behind).
        write_state(
            &path,
            &VmState {
                mem_mib: 1,
                ..value
            },
        )
        .expect("rewrite");
        let back: VmState = read_state(&path).expect("read");
        assert_eq!(back.mem_mib, 1);
        assert_eq!(fs::read_dir(dir.path()).expect("list").count(), 1);
    }

    #[test]
    fn round_trip_buffer_and_empty_body() {
        let bytes = encode_state(&()).expect("encode unit");
        assert_eq!(bytes.len(), MIN_STATE_LEN);
        decode_state::<()>(&bytes).expect("decode unit");
        let bytes = encode_state(&sample()).expect("encode");
        assert_eq!(decode_state::<VmState>(&bytes).expect("decode"), sample());
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = encode_state(&sample()).expect("encode");
        for cut in 0..bytes.len() {
            match decode_state::<VmState>(&bytes[..cut]) {
                Err(StateError::Truncated { len, needed, .. }) => {
                    assert_eq!(len, cut as u64);
                    assert!(needed > len, "cut {cut}: needed {needed}");
                }
                Err(StateError::BadMagic { .. }) => {}
                other => panic!("prefix of {cut} bytes: unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let bytes = encode_state(&sample()).expect("encode");
        for pos in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[pos] ^= 1 << bit;
                let err = decode_state::<VmState>(&bad).expect_err("flipped bit accepted");
                let ok_kind = match pos {
                    0..8 => matches!(err, StateError::BadMagic { .. }),
                    8..12 => matches!(err, StateError::UnsupportedVersion { .. }),
                    12..20 => matches!(
                        err,
                        StateError::Truncated { .. } | StateError::TrailingData { .. }
                    ),
                    _ => matches!(err, StateError::ChecksumMismatch { .. }),
                };
                assert!(ok_kind, "byte {pos} bit {bit}: {err}");
            }
        }
    }

    #[test]
    fn wrong_magic_shows_what_was_found() {
        let mut bytes = encode_state(&sample()).expect("encode");
        bytes[..8].copy_from_slice(b"\x7fELF\x02\x01\x01\x00");
        let err = decode_state::<VmState>(&bytes).expect_err("bad magic");
        assert!(matches!(err, StateError::BadMagic { found, .. } if &found[1..4] == b"ELF"));
        let msg = err.to_string();
        assert!(msg.contains("\\x7fELF"), "{msg}");
        assert!(msg.contains("EMBERSNP"), "{msg}");
    }

    #[test]
    fn newer_and_older_versions_are_refused() {
        let body = body_options().serialize(&sample()).expect("body");
        for version in [0, FORMAT_VERSION + 1, u32::MAX] {
            let err = decode_state::<VmState>(&frame(version, &body)).expect_err("version");
            match err {
                StateError::UnsupportedVersion {
                    found, supported, ..
                } => {
                    assert_eq!(found, version);
                    assert_eq!(supported, FORMAT_VERSION);
                }
                other => panic!("version {version}: {other:?}"),
            }
        }
        let newer = FORMAT_VERSION + 1;
        let msg = decode_state::<VmState>(&frame(newer, &body))
            .expect_err("newer")
            .to_string();
        assert!(msg.contains(&format!("format version {newer}")), "{msg}");
        // Every version in the supported range decodes.
        for version in MIN_FORMAT_VERSION..=FORMAT_VERSION {
            decode_state::<VmState>(&frame(version, &body)).expect("supported version");
        }
    }

    #[test]
    fn trailing_garbage_is_refused() {
        let mut bytes = encode_state(&sample()).expect("encode");
        bytes.extend_from_slice(b"junk");
        match decode_state::<VmState>(&bytes) {
            Err(StateError::TrailingData { extra: 4, .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn huge_body_len_is_refused_without_overflow() {
        let mut bytes = encode_state(&sample()).expect("encode");
        for huge in [u64::MAX, u64::MAX - 27, 1 << 62] {
            bytes[12..20].copy_from_slice(&huge.to_le_bytes());
            match decode_state::<VmState>(&bytes) {
                Err(StateError::Truncated { needed, .. }) => assert!(needed >= huge),
                other => panic!("body_len {huge}: unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn hostile_length_inside_a_valid_body_does_not_allocate() {
        // A body claiming a Vec<u8> of 2^60 bytes, framed with a correct checksum: bincode's
        // limit (body_len) must refuse it before allocating.
        let body = (1u64 << 60).to_le_bytes();
        let err = decode_state::<Vec<u8>>(&frame(FORMAT_VERSION, &body)).expect_err("hostile");
        assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
        let err = decode_state::<Vec<u64>>(&frame(FORMAT_VERSION, &body)).expect_err("hostile");
        assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
        let err = decode_state::<String>(&frame(FORMAT_VERSION, &body)).expect_err("hostile");
        assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn wrong_type_and_leftover_body_are_corrupt() {
        let bytes = encode_state(&(1u64, 2u64)).expect("encode");
        // Asking for less than the body holds: trailing bytes are rejected.
        let err = decode_state::<u64>(&bytes).expect_err("leftover");
        assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
        // Asking for more than it holds.
        let err = decode_state::<(u64, u64, u64)>(&bytes).expect_err("short");
        assert!(matches!(err, StateError::Corrupt { type_name, .. } if type_name.contains("u64")));
    }

    #[test]
    fn file_errors_name_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state");
        let err = read_state::<VmState>(&path).expect_err("missing");
        assert!(matches!(err, StateError::Io { .. }));
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");

        fs::write(&path, b"EMBERSNP").expect("write");
        let err = read_state::<VmState>(&path).expect_err("short");
        assert!(matches!(err, StateError::Truncated { len: 8, .. }));
        assert_eq!(err.origin(), &Origin::File(path.clone()));
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");

        let err = write_state(dir.path().join("no/such/dir/state"), &1u8).expect_err("no dir");
        assert!(err.to_string().contains("no/such/dir/state"), "{err}");
    }

    #[test]
    fn encode_errors_are_reported() {
        struct Unsized;
        impl Serialize for Unsized {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeSeq;
                let seq = s.serialize_seq(None)?;
                seq.end()
            }
        }
        let err = encode_state(&Unsized).expect_err("bincode needs lengths");
        assert!(matches!(err, StateError::Encode { .. }));
    }
}

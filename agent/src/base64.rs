//! Standard-alphabet base64 (RFC 4648 §4), small enough to carry in a PID 1.
//!
//! `ember.run=` on the kernel command line carries a shell command in base64 so that spaces,
//! quotes and newlines survive the kernel's command-line splitting. Decoding accepts input with or
//! without `=` padding; it rejects anything else that is not canonical standard base64 (the URL-safe
//! alphabet, whitespace, stray padding, non-zero trailing bits) with an error that says where.

use thiserror::Error;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Why a base64 string could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Base64Error {
    /// A byte outside the standard alphabet (and not padding in a padding position).
    #[error("invalid base64 character {found:?} at offset {offset} (standard alphabet A-Z a-z 0-9 + / expected)")]
    InvalidByte {
        /// Offset of the byte in the input.
        offset: usize,
        /// The byte found, shown as a char.
        found: char,
    },
    /// The number of data characters cannot come from any byte string (one character left over).
    #[error("invalid base64 length: {len} data characters (a multiple of 4, less 0, 1 or 2, expected); input truncated?")]
    InvalidLength {
        /// Number of characters before any padding.
        len: usize,
    },
    /// `=` somewhere other than the last one or two positions, or the wrong amount of it.
    #[error("invalid base64 padding at offset {offset}")]
    InvalidPadding {
        /// Offset of the first `=`.
        offset: usize,
    },
    /// The last character carries bits that no encoder would set; the input is not canonical.
    #[error("invalid base64: non-zero trailing bits in the last character (offset {offset}); input corrupted?")]
    TrailingBits {
        /// Offset of the last data character.
        offset: usize,
    },
}

fn value_of(byte: u8) -> Option<u8> {
    match byte {
        b'A'..=b'Z' => Some(byte - b'A'),
        b'a'..=b'z' => Some(byte - b'a' + 26),
        b'0'..=b'9' => Some(byte - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decodes standard-alphabet base64, with or without `=` padding.
pub fn decode(input: &[u8]) -> Result<Vec<u8>, Base64Error> {
    // Split off the padding: at most two `=`, only at the end, and only as much as completes a
    // group of four.
    let data_len = input.iter().position(|&b| b == b'=').unwrap_or(input.len());
    let padding = &input[data_len..];
    if padding.len() > 2 || padding.iter().any(|&b| b != b'=') {
        return Err(Base64Error::InvalidPadding { offset: data_len });
    }
    let data = &input[..data_len];

    let mut out = Vec::with_capacity(data.len() / 4 * 3 + 2);
    let mut acc: u32 = 0;
    let mut bits: u32 = 0;
    for (offset, &byte) in data.iter().enumerate() {
        let value = value_of(byte).ok_or(Base64Error::InvalidByte {
            offset,
            found: char::from(byte),
        })?;
        acc = (acc << 6) | u32::from(value);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            // Truncation to the low byte is the point here.
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if data.len() % 4 == 1 {
        return Err(Base64Error::InvalidLength { len: data.len() });
    }
    if !padding.is_empty() && (data.len() + padding.len()) % 4 != 0 {
        return Err(Base64Error::InvalidPadding { offset: data_len });
    }
    if acc != 0 {
        return Err(Base64Error::TrailingBits {
            offset: data.len().saturating_sub(1),
        });
    }
    Ok(out)
}

/// Encodes bytes as standard-alphabet base64 with `=` padding.
///
/// The guest never needs this; it is here for hosts and tests that build `ember.run=` values.
pub fn encode(input: &[u8]) -> String {
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = chunk.len() + 1;
        for i in 0..4 {
            if i < chars {
                let index = (n >> (18 - 6 * i)) & 0x3f;
                out.push(char::from(ALPHABET[index as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4648_vectors_round_trip() {
        let vectors: [(&[u8], &str); 7] = [
            (b"", ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in vectors {
            assert_eq!(encode(plain), encoded);
            assert_eq!(decode(encoded.as_bytes()).as_deref(), Ok(plain));
        }
    }

    #[test]
    fn padding_is_optional() {
        assert_eq!(decode(b"Zg").as_deref(), Ok(&b"f"[..]));
        assert_eq!(decode(b"Zm8").as_deref(), Ok(&b"fo"[..]));
        assert_eq!(decode(b"Zm9vYg").as_deref(), Ok(&b"foob"[..]));
    }

    #[test]
    fn all_byte_values_round_trip() {
        let bytes: Vec<u8> = (0..=255).collect();
        for len in [0, 1, 2, 3, 64, 255, 256] {
            let input = &bytes[..len];
            let encoded = encode(input);
            assert_eq!(decode(encoded.as_bytes()).as_deref(), Ok(input));
            let unpadded = encoded.trim_end_matches('=');
            assert_eq!(decode(unpadded.as_bytes()).as_deref(), Ok(input));
        }
    }

    #[test]
    fn shell_command_with_spaces_and_quotes() {
        let cmd = "echo 'hello world' \"$HOME\"\nexit 3";
        assert_eq!(
            decode(encode(cmd.as_bytes()).as_bytes()).unwrap(),
            cmd.as_bytes()
        );
    }

    #[test]
    fn rejects_bad_characters_with_offset() {
        assert_eq!(
            decode(b"Zm9v*mFy"),
            Err(Base64Error::InvalidByte {
                offset: 4,
                found: '*'
            })
        );
        // URL-safe alphabet is not accepted.
        assert!(matches!(
            decode(b"Zm9-"),
            Err(Base64Error::InvalidByte { offset: 3, .. })
        ));
        // Whitespace is not accepted either.
        assert!(matches!(
            decode(b"Zm9v Zm9v"),
            Err(Base64Error::InvalidByte { offset: 4, .. })
        ));
    }

    #[test]
    fn rejects_bad_length_and_padding() {
        assert_eq!(decode(b"Zm9vY"), Err(Base64Error::InvalidLength { len: 5 }));
        assert_eq!(
            decode(b"Zg==="),
            Err(Base64Error::InvalidPadding { offset: 2 })
        );
        assert_eq!(
            decode(b"Zg=a"),
            Err(Base64Error::InvalidPadding { offset: 2 })
        );
        assert_eq!(
            decode(b"Zm8=="),
            Err(Base64Error::InvalidPadding { offset: 3 })
        );
        assert_eq!(
            decode(b"Zm9v="),
            Err(Base64Error::InvalidPadding { offset: 4 })
        );
        assert_eq!(decode(b"="), Err(Base64Error::InvalidPadding { offset: 0 }));
    }

    #[test]
    fn rejects_non_canonical_trailing_bits() {
        // "Zh" decodes to 'f' with two stray low bits set.
        assert_eq!(decode(b"Zh"), Err(Base64Error::TrailingBits { offset: 1 }));
    }

    #[test]
    fn error_messages_say_what_is_wrong() {
        let msg = decode(b"ab!d").unwrap_err().to_string();
        assert!(msg.contains("'!'") && msg.contains("offset 2"), "{msg}");
        let msg = decode(b"abcde").unwrap_err().to_string();
        assert!(msg.contains("truncated"), "{msg}");
    }
}

//! Ethernet MAC addresses for the guest's interface: parsing user input, deriving a default.

use std::fmt;
use std::str::FromStr;

/// Why a MAC address was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    /// Not six `:`-separated pairs of hex digits.
    #[error("invalid MAC address {input:?}: expected six hex pairs like 02:00:00:aa:bb:cc")]
    Format {
        /// The input as given.
        input: String,
    },
    /// The group bit is set: a guest NIC needs a unicast address.
    #[error("MAC address {mac} is a multicast address (lowest bit of the first octet set)")]
    Multicast {
        /// The address.
        mac: String,
    },
    /// `00:00:00:00:00:00` is not a usable station address.
    #[error("MAC address 00:00:00:00:00:00 is not a usable station address")]
    Zero,
}

/// A unicast, non-zero Ethernet address.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr([u8; 6]);

impl MacAddr {
    /// Length in bytes.
    pub const LEN: usize = 6;

    /// Checks that `bytes` is a usable station address (unicast, not all zero).
    pub fn from_bytes(bytes: [u8; 6]) -> Result<Self, MacError> {
        if bytes == [0; 6] {
            return Err(MacError::Zero);
        }
        if bytes[0] & 1 != 0 {
            return Err(MacError::Multicast {
                mac: fmt_mac(&bytes),
            });
        }
        Ok(Self(bytes))
    }

    /// A locally administered unicast address derived from `seed` (the TAP name): stable for a
    /// given seed, so a VM keeps its address across restarts without configuration.
    pub fn derive(seed: &str) -> Self {
        // FNV-1a, 64 bits: stable across Rust versions (unlike `DefaultHasher`).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in seed.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let x = h.to_le_bytes();
        // 0x02: locally administered, unicast; never all-zero.
        Self([0x02, x[0], x[1], x[2], x[3], x[4]])
    }

    /// The six octets.
    pub fn bytes(&self) -> [u8; 6] {
        self.0
    }

    /// Whether the locally-administered bit is set.
    pub fn is_locally_administered(&self) -> bool {
        self.0[0] & 2 != 0
    }
}

fn fmt_mac(b: &[u8; 6]) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5]
    )
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&fmt_mac(&self.0))
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MacAddr({self})")
    }
}

impl FromStr for MacAddr {
    type Err = MacError;

    /// Parses `aa:bb:cc:dd:ee:ff` (exactly two hex digits per octet, either case).
    fn from_str(s: &str) -> Result<Self, MacError> {
        let bad = || MacError::Format {
            input: s.to_string(),
        };
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for o in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 || !p.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Self::from_bytes(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let m: MacAddr = "02:AB:cd:00:10:ff".parse().unwrap();
        assert_eq!(m.bytes(), [0x02, 0xab, 0xcd, 0x00, 0x10, 0xff]);
        assert_eq!(m.to_string(), "02:ab:cd:00:10:ff");
        assert!(m.is_locally_administered());
    }

    #[test]
    fn rejects_malformed_input() {
        for s in [
            "",
            "02:00:00:00:00",
            "02:00:00:00:00:00:00",
            "02:00:00:00:00:0",
            "02:00:00:00:00:000",
            "02-00-00-00-00-01",
            "02:00:00:00:00:0g",
            "02:00:00:00:00:+1",
            " 02:00:00:00:00:01",
            "02::00:00:00:00:01",
            "02:00:00:00:00:01:",
        ] {
            assert!(
                matches!(s.parse::<MacAddr>(), Err(MacError::Format { .. })),
                "{s:?} accepted"
            );
        }
    }

    #[test]
    fn rejects_multicast_and_zero() {
        assert!(matches!(
            "01:00:5e:00:00:01".parse::<MacAddr>(),
            Err(MacError::Multicast { .. })
        ));
        assert!(matches!(
            "ff:ff:ff:ff:ff:ff".parse::<MacAddr>(),
            Err(MacError::Multicast { .. })
        ));
        assert_eq!("00:00:00:00:00:00".parse::<MacAddr>(), Err(MacError::Zero));
        let e = "03:00:00:00:00:01".parse::<MacAddr>().unwrap_err();
        assert!(e.to_string().contains("03:00:00:00:00:01"), "{e}");
    }

    #[test]
    fn derived_addresses_are_local_unicast_and_stable() {
        let a = MacAddr::derive("tap0");
        assert_eq!(a, MacAddr::derive("tap0"));
        assert_ne!(a, MacAddr::derive("tap1"));
        for seed in ["", "tap0", "a-very-long-name"] {
            let m = MacAddr::derive(seed);
            assert!(m.is_locally_administered());
            assert!(MacAddr::from_bytes(m.bytes()).is_ok());
        }
    }
}

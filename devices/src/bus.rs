//! Address buses for port I/O and MMIO exits.
//!
//! A vCPU thread that exits on an access looks the address up here and calls the device with the
//! offset into its range. Ranges never overlap; lookups are a `BTreeMap` range query.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reachable through a [`Bus`].
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes at `offset` into the device's range.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write of `data` at `offset` into the device's range.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The new range overlaps one already registered.
    #[error(
        "bus range {base:#x}+{len:#x} overlaps an existing device at {other:#x}+{other_len:#x}"
    )]
    Overlap {
        /// Base of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
        /// Base of the range it collides with.
        other: u64,
        /// Length of the range it collides with.
        other_len: u64,
    },
    /// A zero-length range or one that wraps past `u64::MAX`.
    #[error("bus range {base:#x}+{len:#x} is empty or wraps around")]
    InvalidRange {
        /// Base of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
}

/// Shared handle to a device on a bus.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct Entry {
    len: u64,
    device: SharedDevice,
}

/// A set of non-overlapping address ranges, each owned by one device.
#[derive(Clone, Default)]
pub struct Bus {
    entries: BTreeMap<u64, Entry>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<_> = self.entries.iter().map(|(b, e)| (*b, e.len)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `device` for `[base, base + len)`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::InvalidRange { base, len })?;
        // The closest range starting at or below `base`, and the first starting above it.
        let below = self.entries.range(..=base).next_back();
        let above = self.entries.range(base..).find(|(b, _)| **b != base);
        for (b, e) in below.into_iter().chain(above) {
            let other_end = b + e.len;
            if *b < end && base < other_end {
                return Err(BusError::Overlap {
                    base,
                    len,
                    other: *b,
                    other_len: e.len,
                });
            }
        }
        self.entries.insert(base, Entry { len, device });
        Ok(())
    }

    /// Finds the device owning `addr` and the offset of `addr` within its range.
    pub fn resolve(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let (base, entry) = self.entries.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < entry.len).then_some((offset, &entry.device))
    }

    /// Dispatches a read; returns `false` when no device owns `addr` (the data is left as is).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                lock(dev).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; returns `false` when no device owns `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                lock(dev).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned lock: a device that panicked on one thread keeps
/// its (consistent, register-level) state and stays usable rather than taking the VMM down.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo {
        last: Vec<(u64, Vec<u8>)>,
    }

    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last.push((offset, data.to_vec()));
        }
    }

    fn echo() -> Arc<Mutex<Echo>> {
        Arc::new(Mutex::new(Echo { last: Vec::new() }))
    }

    #[test]
    fn dispatches_with_offsets() {
        let mut bus = Bus::new();
        let d = echo();
        bus.insert(d.clone(), 0x3f8, 8).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fa, &mut b));
        assert_eq!(b[0], 2);
        assert!(bus.write(0x3ff, &[9]));
        assert_eq!(d.lock().unwrap().last, vec![(7, vec![9])]);
        assert!(!bus.read(0x400, &mut b));
        assert!(!bus.read(0x3f7, &mut b));
    }

    #[test]
    fn rejects_overlaps_and_bad_ranges() {
        let mut bus = Bus::new();
        bus.insert(echo(), 0x1000, 0x1000).unwrap();
        for (base, len) in [
            (0x1000, 1),
            (0xfff, 2),
            (0x1fff, 1),
            (0x800, 0x1000),
            (0x0, 0x3000),
        ] {
            assert!(
                matches!(bus.insert(echo(), base, len), Err(BusError::Overlap { .. })),
                "{base:#x}+{len:#x}"
            );
        }
        bus.insert(echo(), 0x2000, 0x10).unwrap();
        bus.insert(echo(), 0x0, 0x1000).unwrap();
        assert_eq!(
            bus.insert(echo(), 5, 0),
            Err(BusError::InvalidRange { base: 5, len: 0 })
        );
        assert!(matches!(
            bus.insert(echo(), u64::MAX, 2),
            Err(BusError::InvalidRange { .. })
        ));
    }
}

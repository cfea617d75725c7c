//! The boot-marker port: the guest agent writes one byte here once it is ready, and the VMM
//! records when that happened, measured on the host's monotonic clock. Benchmarks and tests use
//! this instead of scraping the console.

use std::time::Instant;

use crate::bus::BusDevice;

/// The I/O port the guest writes its marker to (agent: `ember_agent::marker::BOOT_MARKER_PORT`).
pub const BOOT_MARKER_PORT: u64 = 0x0ef0;

/// One marker write as the VMM saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootMarkerEvent {
    /// The byte the guest wrote (1 = init ready; others are free for later stages).
    pub value: u8,
    /// When it was written.
    pub at: Instant,
    /// Whether this is the first write seen by this device.
    pub first: bool,
}

/// Callback run (on the vCPU thread) for every marker write; must not block.
pub type MarkerSink = Box<dyn FnMut(BootMarkerEvent) + Send>;

/// The marker port device.
pub struct BootMarker {
    sink: MarkerSink,
    seen: bool,
}

impl std::fmt::Debug for BootMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootMarker")
            .field("seen", &self.seen)
            .finish()
    }
}

impl BootMarker {
    /// A marker port reporting to `sink`.
    pub fn new(sink: MarkerSink) -> Self {
        Self { sink, seen: false }
    }
}

impl BusDevice for BootMarker {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let at = Instant::now();
        if offset != 0 || data.is_empty() {
            return;
        }
        let first = !self.seen;
        self.seen = true;
        (self.sink)(BootMarkerEvent {
            value: data[0],
            at,
            first,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn records_each_write_and_flags_the_first() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let mut m = BootMarker::new(Box::new(move |e| {
            s2.lock().unwrap().push((e.value, e.first))
        }));
        m.write(0, &[1]);
        m.write(1, &[9]);
        m.write(0, &[2, 3]);
        assert_eq!(*seen.lock().unwrap(), vec![(1, true), (2, false)]);
    }
}

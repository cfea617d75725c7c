//! Virtio devices and the virtio-mmio transport (virtio 1.2, split virtqueues).

pub mod block;
pub mod mmio;
pub mod net;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use crate::legacy::EventTrigger;
use crate::GuestMemoryMmap;

/// `VIRTIO_F_VERSION_1`: the only virtio flavour ember speaks (no legacy layouts).
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device type ids (virtio spec, "Device Types").
pub mod device_type {
    /// Network card.
    pub const NET: u32 = 1;
    /// Block device.
    pub const BLOCK: u32 = 2;
    /// Socket device.
    pub const VSOCK: u32 = 19;
}

/// Interrupt causes reported through `InterruptStatus`.
pub mod interrupt_cause {
    /// A used ring was updated.
    pub const VRING: u32 = 1;
    /// The configuration space changed (or the device needs a reset).
    pub const CONFIG: u32 = 2;
}

/// A device's interrupt line plus the `InterruptStatus` register it shares with its transport.
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    irq: EventTrigger,
}

impl Interrupt {
    /// An interrupt line signalling through `irq` (registered with KVM as an irqfd).
    pub fn new(irq: EventTrigger) -> Self {
        Self {
            status: AtomicU32::new(0),
            irq,
        }
    }

    /// Raises the line for `cause` (see [`interrupt_cause`]).
    pub fn trigger(&self, cause: u32) {
        self.status.fetch_or(cause, Ordering::SeqCst);
        if let Err(e) = self.irq.eventfd().write(1) {
            crate::error_limited!("cannot raise a virtio interrupt: {e}");
        }
    }

    /// The pending causes.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// The driver acknowledged `causes`.
    pub fn ack(&self, causes: u32) {
        self.status.fetch_and(!causes, Ordering::SeqCst);
    }

    /// Restores pending causes saved in a snapshot (without raising the line).
    pub fn restore_status(&self, causes: u32) {
        self.status.fetch_or(
            causes & (interrupt_cause::VRING | interrupt_cause::CONFIG),
            Ordering::SeqCst,
        );
    }

    /// Drops every pending cause (device reset).
    pub fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
    }

    /// The eventfd behind the line.
    pub fn eventfd(&self) -> &EventFd {
        self.irq.eventfd()
    }
}

/// Why a device refused to start.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver set up fewer or more queues than the device has.
    #[error("device expects {expected} queues, the driver made {found} ready")]
    QueueCount {
        /// Queues the device has.
        expected: usize,
        /// Queues that were ready.
        found: usize,
    },
    /// A queue's rings do not fit in guest memory or its size is not allowed.
    #[error("queue {0} is not valid (rings outside guest memory or bad size)")]
    InvalidQueue(usize),
    /// The device's backend failed.
    #[error("device backend: {0}")]
    Backend(String),
}

/// A virtio device behind a transport. The transport owns the register file; the device owns the
/// queues once activated and processes them on the VMM's event loop.
pub trait VirtioDevice: Send {
    /// The virtio device type (see [`device_type`]).
    fn device_type(&self) -> u32;
    /// The largest size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers.
    fn avail_features(&self) -> u64;
    /// The features the driver accepted (a subset of `avail_features`), at FEATURES_OK.
    fn set_acked_features(&mut self, features: u64);
    /// Reads the device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device configuration space (ignored by devices with a read-only config).
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device with the driver's queues.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: std::sync::Arc<Interrupt>,
        queues: Vec<Queue>,
    ) -> Result<(), ActivateError>;
    /// Stops the device and drops its queues (driver wrote status 0).
    fn reset(&mut self);
    /// One eventfd per queue: KVM signals it when the guest writes `QueueNotify` (ioeventfd).
    fn queue_events(&self) -> &[EventFd];
    /// Whether the device is running.
    fn is_activated(&self) -> bool;
}

/// A virtqueue's state as stored in a snapshot. It comes from a file, so it is untrusted:
/// [`QueueSnapshot::to_queue`] validates it the way the transport validates a driver's set-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueSnapshot {
    /// Largest size the device allows.
    pub max_size: u16,
    /// Size the driver chose.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available (driver) ring address.
    pub avail_ring: u64,
    /// Used (device) ring address.
    pub used_ring: u64,
    /// Next available-ring index the device will read.
    pub next_avail: u16,
    /// Next used-ring index the device will write.
    pub next_used: u16,
    /// VIRTIO_F_EVENT_IDX negotiated.
    pub event_idx_enabled: bool,
}

impl From<&Queue> for QueueSnapshot {
    fn from(q: &Queue) -> Self {
        let s = q.state();
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
        }
    }
}

impl QueueSnapshot {
    /// Rebuilds the queue; refuses sizes the device does not allow and, when `mem` is given,
    /// rings outside guest memory.
    pub fn to_queue(&self, mem: Option<&GuestMemoryMmap>) -> Result<Queue, ActivateError> {
        use virtio_queue::QueueT;
        let state = virtio_queue::QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx_enabled,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        };
        let q = Queue::try_from(state)
            .map_err(|e| ActivateError::Backend(format!("queue state from snapshot: {e}")))?;
        if let Some(mem) = mem {
            if q.ready() && !q.is_valid(mem) {
                return Err(ActivateError::Backend(
                    "queue rings from snapshot lie outside guest memory".into(),
                ));
            }
        }
        Ok(q)
    }
}

/// Copies `src` into `dst` at `offset` of a config space, clipping at both ends.
pub fn read_config_bytes(space: &[u8], offset: u64, data: &mut [u8]) {
    let Ok(off) = usize::try_from(offset) else {
        data.fill(0);
        return;
    };
    data.fill(0);
    if off < space.len() {
        let n = data.len().min(space.len() - off);
        data[..n].copy_from_slice(&space[off..off + n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupt_status_tracks_causes() {
        let i = Interrupt::new(EventTrigger::new().unwrap());
        i.trigger(interrupt_cause::VRING);
        i.trigger(interrupt_cause::CONFIG);
        assert_eq!(i.status(), 3);
        assert_eq!(i.eventfd().read().unwrap(), 2);
        i.ack(interrupt_cause::VRING);
        assert_eq!(i.status(), interrupt_cause::CONFIG);
        i.clear();
        assert_eq!(i.status(), 0);
    }

    #[test]
    fn queue_snapshot_round_trip_and_validation() {
        use virtio_queue::QueueT;
        let mem = GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x10000)]).unwrap();
        let mut q = Queue::new(16).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), Some(0));
        q.set_avail_ring_address(Some(0x2000), Some(0));
        q.set_used_ring_address(Some(0x3000), Some(0));
        q.set_ready(true);
        let s = QueueSnapshot::from(&q);
        let back = s.to_queue(Some(&mem)).unwrap();
        assert_eq!(QueueSnapshot::from(&back), s);
        let mut bad = s;
        bad.used_ring = 0xffff_0000;
        assert!(bad.to_queue(Some(&mem)).is_err());
        let mut bad = s;
        bad.size = 7;
        assert!(bad.to_queue(None).is_err());
    }

    #[test]
    fn config_reads_clip() {
        let space = [1u8, 2, 3, 4];
        let mut d = [9u8; 3];
        read_config_bytes(&space, 2, &mut d);
        assert_eq!(d, [3, 4, 0]);
        read_config_bytes(&space, 100, &mut d);
        assert_eq!(d, [0, 0, 0]);
        read_config_bytes(&space, u64::MAX, &mut d);
        assert_eq!(d, [0, 0, 0]);
    }
}

//! The virtio-mmio transport (virtio 1.2 §4.2, "modern" version 2 register layout).
//!
//! The transport owns the register file and the queue configuration until the driver sets
//! DRIVER_OK; then it hands the queues to the device. Queue notifications normally never reach
//! this code: the VMM registers each queue's eventfd as a KVM ioeventfd on `QueueNotify`, so a
//! notify costs no exit to user space. A notify that does arrive here (no ioeventfd) is
//! forwarded to the same eventfd.

use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};

use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::bus::{lock, BusDevice};
use crate::legacy::EventTrigger;
use crate::GuestMemoryMmap;

/// Size of one device's MMIO window.
pub const MMIO_WINDOW_LEN: u64 = 0x1000;
/// Offset of `QueueNotify` (for ioeventfd registration).
pub const NOTIFY_OFFSET: u64 = 0x50;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x454d_4252; // "EMBR"

/// Device status bits.
pub mod status {
    /// The guest noticed the device.
    pub const ACKNOWLEDGE: u32 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u32 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u32 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u32 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u32 = 0x80;
}

/// Register-level state of the transport, for snapshots.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MmioTransportState {
    /// `DeviceFeaturesSel`.
    pub features_select: u32,
    /// `DriverFeaturesSel`.
    pub acked_features_select: u32,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// `QueueSel`.
    pub queue_select: u32,
    /// `Status`.
    pub status: u32,
    /// `ConfigGeneration`.
    pub config_generation: u32,
    /// `InterruptStatus`.
    pub interrupt_status: u32,
}

/// A virtio device on the MMIO transport.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    regs: MmioTransportState,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("regs", &self.regs)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// Wraps `device`; `irq` is the eventfd the VMM registers as the device's irqfd.
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        irq: EventTrigger,
    ) -> Result<Self, virtio_queue::Error> {
        let queues = lock(&device)
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            device,
            mem,
            interrupt: Arc::new(Interrupt::new(irq)),
            queues,
            regs: MmioTransportState::default(),
        })
    }

    /// Like [`MmioTransport::new`] with an interrupt line built by the caller (restore: the
    /// device and the transport must share it, with its saved status).
    pub fn with_interrupt(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        interrupt: Arc<Interrupt>,
    ) -> Result<Self, virtio_queue::Error> {
        let queues = lock(&device)
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            device,
            mem,
            interrupt,
            queues,
            regs: MmioTransportState::default(),
        })
    }

    /// The transport's copy of the queue registers, for snapshots.
    pub fn queue_snapshots(&self) -> Vec<super::QueueSnapshot> {
        self.queues.iter().map(super::QueueSnapshot::from).collect()
    }

    /// Restores registers and queue configuration saved by [`MmioTransport::state`] and
    /// [`MmioTransport::queue_snapshots`]. The interrupt status is restored by the caller on
    /// the shared [`Interrupt`]. Refuses queue sets that do not match the device.
    pub fn restore_state(
        &mut self,
        regs: &MmioTransportState,
        queues: &[super::QueueSnapshot],
    ) -> Result<(), super::ActivateError> {
        if queues.len() != self.queues.len() {
            return Err(super::ActivateError::QueueCount {
                expected: self.queues.len(),
                found: queues.len(),
            });
        }
        let mut restored = Vec::with_capacity(queues.len());
        for (i, (q, cur)) in queues.iter().zip(&self.queues).enumerate() {
            if q.max_size != cur.max_size() {
                return Err(super::ActivateError::InvalidQueue(i));
            }
            restored.push(q.to_queue(None)?);
        }
        self.queues = restored;
        self.regs = regs.clone();
        self.regs.interrupt_status = 0;
        Ok(())
    }

    /// The device behind the transport.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The interrupt line shared with the device.
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// The register state (for snapshots).
    pub fn state(&self) -> MmioTransportState {
        let mut s = self.regs.clone();
        s.interrupt_status = self.interrupt.status();
        s
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        // Queue configuration is only writable between FEATURES_OK and DRIVER_OK.
        let st = self.regs.status;
        if st & status::FEATURES_OK == 0 || st & (status::DRIVER_OK | status::FAILED) != 0 {
            return None;
        }
        self.queues.get_mut(self.regs.queue_select as usize)
    }

    fn queue_read(&self, f: impl Fn(&Queue) -> u32) -> u32 {
        self.queues
            .get(self.regs.queue_select as usize)
            .map(f)
            .unwrap_or(0)
    }

    fn reset(&mut self) {
        lock(&self.device).reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.clear();
        self.regs = MmioTransportState::default();
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.regs.status;
        // The driver may only add bits (§3.1.1); anything else is ignored.
        if value & old != old {
            crate::warn_limited!(
                "virtio-mmio: driver tried to clear status bits {old:#x} -> {value:#x}"
            );
            return;
        }
        let added = value & !old;
        if added & status::FEATURES_OK != 0 {
            let dev = lock(&self.device);
            let offered = dev.avail_features();
            drop(dev);
            let acked = self.regs.acked_features;
            if acked & !offered != 0 || acked & VIRTIO_F_VERSION_1 == 0 {
                crate::warn_limited!(
                    "virtio-mmio: driver accepted features {acked:#x} outside {offered:#x} \
                     or without VERSION_1; FEATURES_OK refused"
                );
                self.regs.status = value & !status::FEATURES_OK;
                return;
            }
            lock(&self.device).set_acked_features(acked);
        }
        if added & status::DRIVER_OK != 0 {
            if value & status::FEATURES_OK == 0 {
                crate::warn_limited!("virtio-mmio: DRIVER_OK without FEATURES_OK");
                self.regs.status = value & !status::DRIVER_OK;
                return;
            }
            self.regs.status = value;
            self.activate();
            return;
        }
        self.regs.status = value;
    }

    fn activate(&mut self) {
        let result = (|| {
            let ready: Vec<usize> = (0..self.queues.len())
                .filter(|&i| self.queues[i].ready())
                .collect();
            if ready.len() != self.queues.len() {
                return Err(super::ActivateError::QueueCount {
                    expected: self.queues.len(),
                    found: ready.len(),
                });
            }
            if let Some(bad) = (0..self.queues.len()).find(|&i| !self.queues[i].is_valid(&self.mem))
            {
                return Err(super::ActivateError::InvalidQueue(bad));
            }
            // The transport keeps its copy of the queue registers (reads of QueueReady etc.
            // after DRIVER_OK); the device gets its own.
            let queues = self
                .queues
                .iter()
                .map(|q| Queue::try_from(q.state()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| super::ActivateError::Backend(e.to_string()))?;
            lock(&self.device).activate(self.mem.clone(), self.interrupt.clone(), queues)
        })();
        if let Err(e) = result {
            crate::warn_limited!(
                "virtio-mmio: device type {} refused to start: {e}",
                self.device_type()
            );
            self.regs.status |= status::DEVICE_NEEDS_RESET;
            self.interrupt.trigger(super::interrupt_cause::CONFIG);
        }
    }

    fn device_type(&self) -> u32 {
        lock(&self.device).device_type()
    }

    fn read_reg(&self, offset: u64) -> u32 {
        match offset {
            0x00 => MAGIC,
            0x04 => VERSION,
            0x08 => self.device_type(),
            0x0c => VENDOR_ID,
            0x10 => {
                let f = lock(&self.device).avail_features();
                match self.regs.features_select {
                    0 => f as u32,
                    1 => (f >> 32) as u32,
                    _ => 0,
                }
            }
            0x34 => self.queue_read(|q| u32::from(q.max_size())),
            0x44 => self.queue_read(|q| u32::from(q.ready())),
            0x60 => self.interrupt.status(),
            0x70 => self.regs.status,
            0xfc => self.regs.config_generation,
            _ => {
                crate::debug_limited!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        let driver_stage =
            self.regs.status & status::DRIVER != 0 && self.regs.status & status::FEATURES_OK == 0;
        match offset {
            0x14 => self.regs.features_select = v,
            0x20 if driver_stage => match self.regs.acked_features_select {
                0 => {
                    self.regs.acked_features =
                        (self.regs.acked_features & !0xffff_ffff) | u64::from(v)
                }
                1 => {
                    self.regs.acked_features =
                        (self.regs.acked_features & 0xffff_ffff) | (u64::from(v) << 32)
                }
                _ => {}
            },
            0x24 => self.regs.acked_features_select = v,
            0x30 => self.regs.queue_select = v,
            0x38 => {
                if let Some(q) = self.selected_queue() {
                    // Sizes must be powers of two no larger than the maximum; `Queue` keeps the
                    // old size otherwise and the queue fails validation at DRIVER_OK.
                    if let Ok(size) = u16::try_from(v) {
                        if q.try_set_size(size).is_err() {
                            crate::warn_limited!("virtio-mmio: invalid queue size {v}");
                        }
                    }
                }
            }
            0x44 => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(v == 1);
                }
            }
            0x50 => {
                // Only reached without an ioeventfd: forward to the queue's eventfd.
                let dev = lock(&self.device);
                if let Some(evt) = dev.queue_events().get(v as usize) {
                    let _ = evt.write(1);
                }
            }
            0x64 => self.interrupt.ack(v),
            0x70 => self.set_status(v),
            0x80 => self.with_queue(|q| q.set_desc_table_address(Some(v), None)),
            0x84 => self.with_queue(|q| q.set_desc_table_address(None, Some(v))),
            0x90 => self.with_queue(|q| q.set_avail_ring_address(Some(v), None)),
            0x94 => self.with_queue(|q| q.set_avail_ring_address(None, Some(v))),
            0xa0 => self.with_queue(|q| q.set_used_ring_address(Some(v), None)),
            0xa4 => self.with_queue(|q| q.set_used_ring_address(None, Some(v))),
            _ => crate::debug_limited!(
                "virtio-mmio: write of {v:#x} to register {offset:#x} ignored"
            ),
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= 0x100 {
            lock(&self.device).read_config(offset - 0x100, data);
            return;
        }
        // Registers are 32 bits wide and must be accessed as such.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= 0x100 {
            if self.regs.status & status::FAILED == 0 {
                lock(&self.device).write_config(offset - 0x100, data);
                self.regs.config_generation = self.regs.config_generation.wrapping_add(1);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return;
        };
        if !offset.is_multiple_of(4) {
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::ActivateError;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    struct Dummy {
        evts: Vec<EventFd>,
        acked: u64,
        active: bool,
        resets: usize,
    }

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn avail_features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 0b101
        }
        fn set_acked_features(&mut self, f: u64) {
            self.acked = f;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            super::super::read_config_bytes(&[7, 8, 9], offset, data);
        }
        fn write_config(&mut self, _: u64, _: &[u8]) {}
        fn activate(
            &mut self,
            _: GuestMemoryMmap,
            _: Arc<Interrupt>,
            qs: Vec<Queue>,
        ) -> Result<(), ActivateError> {
            assert_eq!(qs.len(), 2);
            self.active = true;
            Ok(())
        }
        fn reset(&mut self) {
            self.active = false;
            self.resets += 1;
        }
        fn queue_events(&self) -> &[EventFd] {
            &self.evts
        }
        fn is_activated(&self) -> bool {
            self.active
        }
    }

    fn setup() -> (MmioTransport, Arc<Mutex<Dummy>>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let dev = Arc::new(Mutex::new(Dummy {
            evts: vec![EventFd::new(0).unwrap(), EventFd::new(0).unwrap()],
            acked: 0,
            active: false,
            resets: 0,
        }));
        let t = MmioTransport::new(mem, dev.clone(), EventTrigger::new().unwrap()).unwrap();
        (t, dev)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }
    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn negotiate(t: &mut MmioTransport, features_hi: u32) {
        w(t, 0x70, status::ACKNOWLEDGE);
        w(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(t, 0x24, 0);
        w(t, 0x20, 0b1);
        w(t, 0x24, 1);
        w(t, 0x20, features_hi);
        w(
            t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    fn setup_queue(t: &mut MmioTransport, idx: u32, base: u32) {
        w(t, 0x30, idx);
        w(t, 0x38, 16);
        w(t, 0x80, base);
        w(t, 0x90, base + 0x1000);
        w(t, 0xa0, base + 0x2000);
        w(t, 0x44, 1);
    }

    #[test]
    fn identification_registers() {
        let (mut t, _) = setup();
        assert_eq!(r(&mut t, 0), MAGIC);
        assert_eq!(r(&mut t, 4), 2);
        assert_eq!(r(&mut t, 8), 42);
        w(&mut t, 0x14, 1);
        assert_eq!(r(&mut t, 0x10), 1);
        w(&mut t, 0x14, 0);
        assert_eq!(r(&mut t, 0x10), 0b101);
        let mut c = [0u8; 2];
        t.read(0x101, &mut c);
        assert_eq!(c, [8, 9]);
        // Misaligned and narrow register accesses are ignored.
        let mut b = [0xffu8; 2];
        t.read(0, &mut b);
        assert_eq!(b, [0, 0]);
    }

    #[test]
    fn full_negotiation_activates_and_reset_resets() {
        let (mut t, dev) = setup();
        negotiate(&mut t, 1);
        assert_eq!(dev.lock().unwrap().acked, VIRTIO_F_VERSION_1 | 1);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0x2_0000);
        w(&mut t, 0x70, 0xf);
        assert!(dev.lock().unwrap().active);
        assert_eq!(r(&mut t, 0x70), 0xf);
        // Queue registers are frozen after DRIVER_OK.
        w(&mut t, 0x30, 0);
        w(&mut t, 0x44, 0);
        assert_eq!(r(&mut t, 0x44), 1);
        w(&mut t, 0x70, 0);
        assert!(!dev.lock().unwrap().active);
        assert_eq!(r(&mut t, 0x70), 0);
        assert_eq!(r(&mut t, 0x44), 0);
    }

    #[test]
    fn features_without_version_1_are_refused() {
        let (mut t, _) = setup();
        negotiate(&mut t, 0);
        assert_eq!(r(&mut t, 0x70) & status::FEATURES_OK, 0);
    }

    #[test]
    fn unoffered_features_are_refused() {
        let (mut t, _) = setup();
        w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, 0x20, 0b10);
        w(&mut t, 0x24, 1);
        w(&mut t, 0x20, 1);
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        assert_eq!(r(&mut t, 0x70) & status::FEATURES_OK, 0);
    }

    #[test]
    fn rings_outside_memory_need_reset_instead_of_activation() {
        let (mut t, dev) = setup();
        negotiate(&mut t, 1);
        setup_queue(&mut t, 0, 0x1_0000);
        setup_queue(&mut t, 1, 0xfff0_0000);
        w(&mut t, 0x70, 0xf);
        assert!(!dev.lock().unwrap().active);
        assert_ne!(r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_ne!(r(&mut t, 0x60) & super::super::interrupt_cause::CONFIG, 0);
    }

    #[test]
    fn missing_queue_is_refused() {
        let (mut t, dev) = setup();
        negotiate(&mut t, 1);
        setup_queue(&mut t, 0, 0x1_0000);
        w(&mut t, 0x70, 0xf);
        assert!(!dev.lock().unwrap().active);
    }

    #[test]
    fn notify_without_ioeventfd_reaches_the_queue_event() {
        let (mut t, dev) = setup();
        w(&mut t, 0x50, 1);
        w(&mut t, 0x50, 7);
        assert_eq!(dev.lock().unwrap().evts[1].read().unwrap(), 1);
    }

    #[test]
    fn bad_register_writes_in_a_loop_are_rate_limited() {
        use crate::ratelimit::capture::{suppressed_counts, Capture};
        use crate::ratelimit::{test_clock, BURST, REFILL_INTERVAL};
        let (mut t, _) = setup();
        negotiate(&mut t, 1);
        w(&mut t, 0x30, 0);
        let capture = Capture::default();
        tracing::subscriber::with_default(capture.clone(), || {
            // Queue sizes must be powers of two: each write is refused with a warning.
            for _ in 0..1000 {
                w(&mut t, 0x38, 3);
            }
            test_clock::advance(REFILL_INTERVAL);
            w(&mut t, 0x38, 5);
        });
        let lines = capture.lines();
        let refused: Vec<_> = lines
            .iter()
            .filter(|(_, m)| m.starts_with("virtio-mmio: invalid queue size"))
            .collect();
        assert_eq!(refused.len() as u64, BURST + 1, "{lines:#?}");
        assert_eq!(
            refused.last().map(|l| l.1.as_str()),
            Some("virtio-mmio: invalid queue size 5")
        );
        assert_eq!(suppressed_counts(&lines), vec![1000 - BURST], "{lines:#?}");
        assert_eq!(lines.len() as u64, BURST + 2, "{lines:#?}");
        // The queue kept its valid size throughout.
        assert_eq!(t.queues[0].size(), 16);
    }

    #[test]
    fn status_bits_cannot_be_cleared_piecemeal() {
        let (mut t, _) = setup();
        w(&mut t, 0x70, 3);
        w(&mut t, 0x70, 1);
        assert_eq!(r(&mut t, 0x70), 3);
    }
}

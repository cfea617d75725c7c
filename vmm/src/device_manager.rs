//! Places devices on the buses, wires their interrupts (irqfd) and queue notifications
//! (ioeventfd) to KVM, registers their event handlers on the event loop, and produces the
//! kernel command-line entries that announce virtio-mmio devices.

use std::sync::{Arc, Mutex};

use ember_devices::bus::{Bus, BusDevice, BusError};
use ember_devices::legacy::{
    BootMarker, EventTrigger, Serial, BOOT_MARKER_PORT, I8042, I8042_PORT_BASE, I8042_PORT_LEN,
    SERIAL_COM1_BASE, SERIAL_COM1_IRQ, SERIAL_PORT_LEN,
};
use ember_devices::virtio::block::Block;
use ember_devices::virtio::mmio::{
    MmioTransport, MmioTransportState, MMIO_WINDOW_LEN, NOTIFY_OFFSET,
};
use ember_devices::virtio::net::Net;
use ember_devices::virtio::vsock::Vsock;
use ember_devices::virtio::{Interrupt, QueueSnapshot, VirtioDevice};
use ember_devices::GuestMemoryMmap;
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{IoEventAddress, VmFd};

use crate::memory::{MMIO_GAP_END, VIRTIO_MMIO_BASE};

/// The type every event-loop subscriber is stored as.
pub type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;
/// The VMM's event loop.
pub type EventLoop = EventManager<Subscriber>;

/// First GSI handed to virtio devices (0-4 are the PIT, keyboard, cascade, COM2, COM1).
pub const VIRTIO_FIRST_IRQ: u32 = 5;
/// Last usable GSI on KVM's in-kernel IOAPIC.
pub const LAST_IRQ: u32 = 23;

/// Errors wiring devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Bus placement failed.
    #[error("device placement: {0}")]
    Bus(#[from] BusError),
    /// A KVM ioctl failed.
    #[error("KVM {what} failed: {source}")]
    Kvm {
        /// The ioctl.
        what: &'static str,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// Out of interrupt lines or MMIO space.
    #[error("too many devices: no {0} left")]
    Exhausted(&'static str),
    /// An eventfd could not be made.
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    /// The virtio transport could not be built.
    #[error("virtio transport: {0}")]
    Transport(String),
}

/// A placed virtio device with its concrete type (for snapshots).
#[derive(Debug, Clone)]
pub enum VirtioHandle {
    /// virtio-blk.
    Block(Arc<Mutex<Block>>),
    /// virtio-net.
    Net(Arc<Mutex<Net>>),
    /// virtio-vsock.
    Vsock(Arc<Mutex<Vsock>>),
}

/// One virtio device as placed.
#[derive(Debug, Clone)]
pub struct VirtioSlot {
    /// MMIO window base.
    pub base: u64,
    /// Its GSI.
    pub irq: u32,
    /// The transport.
    pub transport: Arc<Mutex<MmioTransport>>,
    /// The device.
    pub handle: VirtioHandle,
}

/// Owns the buses while the VM is being built.
#[derive(Debug, Default)]
pub struct DeviceManager {
    /// Port-I/O bus.
    pub pio: Bus,
    /// MMIO bus.
    pub mmio: Bus,
    /// Placed virtio devices, in order (the first disk is /dev/vda).
    pub virtio: Vec<VirtioSlot>,
    /// The UART, for input and snapshots.
    pub serial: Option<Arc<Mutex<Serial>>>,
    /// Written when the guest drains the UART's receive FIFO (for console input).
    pub serial_drained: Option<vmm_sys_util::eventfd::EventFd>,
    next_irq: u32,
    next_mmio: u64,
}

impl DeviceManager {
    /// An empty device manager.
    pub fn new() -> Self {
        Self {
            next_irq: VIRTIO_FIRST_IRQ,
            next_mmio: VIRTIO_MMIO_BASE,
            ..Default::default()
        }
    }

    /// The vsock device, if the VM has one.
    pub fn vsock(&self) -> Option<&Arc<Mutex<Vsock>>> {
        self.virtio.iter().find_map(|s| match &s.handle {
            VirtioHandle::Vsock(v) => Some(v),
            _ => None,
        })
    }

    /// The vsock device's counters (`null` without one), for `stats`.
    pub fn vsock_metrics(&self) -> serde_json::Value {
        self.vsock()
            .map(|v| {
                let m = v.lock().unwrap_or_else(|p| p.into_inner()).metrics();
                serde_json::to_value(m).unwrap_or_default()
            })
            .unwrap_or_default()
    }

    /// COM1, with its interrupt wired to GSI 4.
    pub fn add_serial(
        &mut self,
        vm: &VmFd,
        out: ember_devices::legacy::SerialOut,
    ) -> Result<Arc<Mutex<Serial>>, DeviceError> {
        let irq = EventTrigger::new().map_err(DeviceError::EventFd)?;
        let drained = self.new_drained_event()?;
        self.add_serial_device(vm, Serial::with_input_events(irq, out, Some(drained)))
    }

    /// The eventfd a UART signals when its receive FIFO empties; keeps a copy for the console.
    pub fn new_drained_event(&mut self) -> Result<vmm_sys_util::eventfd::EventFd, DeviceError> {
        let e = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)
            .map_err(DeviceError::EventFd)?;
        let copy = e.try_clone().map_err(DeviceError::EventFd)?;
        self.serial_drained = Some(copy);
        Ok(e)
    }

    /// Places an already built COM1 (e.g. restored from a snapshot).
    pub fn add_serial_device(
        &mut self,
        vm: &VmFd,
        serial: Serial,
    ) -> Result<Arc<Mutex<Serial>>, DeviceError> {
        vm.register_irqfd(serial.irq().eventfd(), SERIAL_COM1_IRQ)
            .map_err(|source| DeviceError::Kvm {
                what: "KVM_IRQFD (serial)",
                source,
            })?;
        let serial = Arc::new(Mutex::new(serial));
        self.pio
            .insert(serial.clone(), SERIAL_COM1_BASE, SERIAL_PORT_LEN)?;
        self.serial = Some(serial.clone());
        Ok(serial)
    }

    /// The i8042 reset line; returns the eventfd written when the guest resets.
    pub fn add_i8042(&mut self) -> Result<vmm_sys_util::eventfd::EventFd, DeviceError> {
        let reset = EventTrigger::new().map_err(DeviceError::EventFd)?;
        let evt = reset.eventfd().try_clone().map_err(DeviceError::EventFd)?;
        self.pio.insert(
            Arc::new(Mutex::new(I8042::new(reset))),
            I8042_PORT_BASE,
            I8042_PORT_LEN,
        )?;
        Ok(evt)
    }

    /// The boot-marker port.
    pub fn add_boot_marker(&mut self, marker: BootMarker) -> Result<(), DeviceError> {
        self.pio
            .insert(Arc::new(Mutex::new(marker)), BOOT_MARKER_PORT, 1)?;
        Ok(())
    }

    /// The next free MMIO window and interrupt line.
    pub fn next_slot(&self) -> Result<(u64, u32), DeviceError> {
        if self.next_irq > LAST_IRQ {
            return Err(DeviceError::Exhausted("interrupt lines"));
        }
        // Keep the top of the gap free for the IOAPIC (0xfec00000) and LAPIC (0xfee00000).
        if self.next_mmio + MMIO_WINDOW_LEN > MMIO_GAP_END - 0x0400_0000 {
            return Err(DeviceError::Exhausted("MMIO space"));
        }
        Ok((self.next_mmio, self.next_irq))
    }

    /// Places a new virtio device in the next free slot.
    pub fn add_virtio<D>(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        events: &mut EventLoop,
        device: Arc<Mutex<D>>,
        handle: VirtioHandle,
    ) -> Result<VirtioSlot, DeviceError>
    where
        D: VirtioDevice + MutEventSubscriber + 'static,
    {
        let (base, irq) = self.next_slot()?;
        let interrupt = Arc::new(Interrupt::new(
            EventTrigger::new().map_err(DeviceError::EventFd)?,
        ));
        self.attach_virtio(vm, mem, events, device, handle, base, irq, interrupt, None)
    }

    /// Places a virtio device at `base`/`irq`: MMIO window, irqfd, one ioeventfd per queue,
    /// event handler; with `restore`, the transport's registers come from a snapshot.
    #[allow(clippy::too_many_arguments)]
    pub fn attach_virtio<D>(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        events: &mut EventLoop,
        device: Arc<Mutex<D>>,
        handle: VirtioHandle,
        base: u64,
        irq: u32,
        interrupt: Arc<Interrupt>,
        restore: Option<(&MmioTransportState, &[QueueSnapshot])>,
    ) -> Result<VirtioSlot, DeviceError>
    where
        D: VirtioDevice + MutEventSubscriber + 'static,
    {
        if !(VIRTIO_FIRST_IRQ..=LAST_IRQ).contains(&irq)
            || !(VIRTIO_MMIO_BASE..MMIO_GAP_END - 0x0400_0000).contains(&base)
            || !base.is_multiple_of(MMIO_WINDOW_LEN)
        {
            return Err(DeviceError::Transport(format!(
                "virtio slot {base:#x}/IRQ {irq} is outside the virtio ranges"
            )));
        }
        vm.register_irqfd(interrupt.eventfd(), irq)
            .map_err(|source| DeviceError::Kvm {
                what: "KVM_IRQFD (virtio)",
                source,
            })?;
        {
            let dev = device.lock().unwrap_or_else(|p| p.into_inner());
            for (i, evt) in dev.queue_events().iter().enumerate() {
                vm.register_ioevent(evt, &IoEventAddress::Mmio(base + NOTIFY_OFFSET), i as u32)
                    .map_err(|source| DeviceError::Kvm {
                        what: "KVM_IOEVENTFD",
                        source,
                    })?;
            }
        }
        let as_virtio: Arc<Mutex<dyn VirtioDevice>> = device.clone();
        let mut transport = MmioTransport::with_interrupt(mem.clone(), as_virtio, interrupt)
            .map_err(|e| DeviceError::Transport(e.to_string()))?;
        if let Some((regs, queues)) = restore {
            transport
                .restore_state(regs, queues)
                .map_err(|e| DeviceError::Transport(e.to_string()))?;
        }
        let transport = Arc::new(Mutex::new(transport));
        let as_bus: Arc<Mutex<dyn BusDevice>> = transport.clone();
        self.mmio.insert(as_bus, base, MMIO_WINDOW_LEN)?;
        let sub: Subscriber = device;
        events.add_subscriber(sub);
        self.next_irq = self.next_irq.max(irq + 1);
        self.next_mmio = self.next_mmio.max(base + MMIO_WINDOW_LEN);
        let slot = VirtioSlot {
            base,
            irq,
            transport,
            handle,
        };
        self.virtio.push(slot.clone());
        Ok(slot)
    }

    /// `virtio_mmio.device=` entries announcing every placed virtio device to the kernel.
    pub fn cmdline_entries(&self) -> Vec<String> {
        self.virtio
            .iter()
            .map(|s| virtio_mmio_cmdline(s.base, s.irq))
            .collect()
    }
}

/// The kernel parameter for one virtio-mmio device.
pub fn virtio_mmio_cmdline(base: u64, irq: u32) -> String {
    format!("virtio_mmio.device=4K@{base:#x}:{irq}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_entry_format() {
        assert_eq!(
            virtio_mmio_cmdline(0xd000_0000, 5),
            "virtio_mmio.device=4K@0xd0000000:5"
        );
    }
}

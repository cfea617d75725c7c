//! Legacy port-I/O devices: the 8250 UART, the i8042 reset line and the boot-marker port.

mod boot_marker;
mod i8042;
mod serial;

pub use boot_marker::{BootMarker, BootMarkerEvent, MarkerSink, BOOT_MARKER_PORT};
pub use i8042::{I8042, I8042_PORT_BASE, I8042_PORT_LEN};
pub use serial::{
    Serial, SerialOut, SerialSnapshot, SERIAL_COM1_BASE, SERIAL_COM1_IRQ, SERIAL_PORT_LEN,
};

use vmm_sys_util::eventfd::EventFd;

/// An eventfd that a device writes to raise an event: an interrupt line (registered with KVM
/// as an irqfd) or a notification to the VMM's event loop.
#[derive(Debug)]
pub struct EventTrigger(pub EventFd);

impl EventTrigger {
    /// A new non-blocking eventfd trigger.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self(EventFd::new(libc::EFD_NONBLOCK)?))
    }

    /// The underlying eventfd (to register it as an irqfd or with epoll).
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl vm_superio::Trigger for EventTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

//! The 8250 UART at COM1 (0x3f8, IRQ 4), built on vm-superio.

use std::io::Write;

use vm_superio::serial::NoEvents;

use super::EventTrigger;
use crate::bus::BusDevice;

/// Base port of COM1.
pub const SERIAL_COM1_BASE: u64 = 0x3f8;
/// Number of ports the UART decodes.
pub const SERIAL_PORT_LEN: u64 = 8;
/// The legacy IRQ line of COM1.
pub const SERIAL_COM1_IRQ: u32 = 4;

/// Where guest console output goes.
pub type SerialOut = Box<dyn Write + Send>;

/// COM1: guest output goes to `out`, input is queued with [`Serial::enqueue_input`].
pub struct Serial {
    inner: vm_superio::Serial<EventTrigger, NoEvents, SerialOut>,
}

impl std::fmt::Debug for Serial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serial").finish_non_exhaustive()
    }
}

impl Serial {
    /// A UART raising `irq` when it needs attention and writing guest output to `out`.
    pub fn new(irq: EventTrigger, out: SerialOut) -> Self {
        Self {
            inner: vm_superio::Serial::new(irq, out),
        }
    }

    /// The interrupt eventfd (to register as the irqfd of IRQ 4).
    pub fn irq(&self) -> &EventTrigger {
        self.inner.interrupt_evt()
    }

    /// Queues bytes for the guest to read; returns how many fit in the receive FIFO.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.inner
            .enqueue_raw_bytes(bytes)
            .map_err(|e| std::io::Error::other(format!("serial input: {e:?}")))
    }

    /// Room left in the receive FIFO.
    pub fn input_capacity(&self) -> usize {
        self.inner.fifo_capacity()
    }

    /// Register-level state, for snapshots.
    pub fn state(&self) -> vm_superio::serial::SerialState {
        self.inner.state()
    }

    /// Rebuilds the UART from saved register state.
    pub fn from_state(
        state: &vm_superio::serial::SerialState,
        irq: EventTrigger,
        out: SerialOut,
    ) -> std::io::Result<Self> {
        let inner = vm_superio::Serial::from_state(state, irq, NoEvents, out)
            .map_err(|e| std::io::Error::other(format!("serial state: {e:?}")))?;
        Ok(Self { inner })
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // The UART has byte-wide registers; wider accesses read as all ones.
        match (u8::try_from(offset), data) {
            (Ok(off), [b]) => *b = self.inner.read(off),
            (_, data) => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [b]) = (u8::try_from(offset), data) {
            if let Err(e) = self.inner.write(off, *b) {
                tracing::warn!("serial write at offset {off}: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn output_reaches_the_sink_and_input_is_readable() {
        let sink = Sink::default();
        let mut s = Serial::new(EventTrigger::new().unwrap(), Box::new(sink.clone()));
        for b in b"hi" {
            s.write(0, &[*b]);
        }
        assert_eq!(&*sink.0.lock().unwrap(), b"hi");
        // Enable the received-data interrupt, queue a byte, read it back.
        s.write(1, &[1]);
        assert_eq!(s.enqueue_input(b"x").unwrap(), 1);
        assert_eq!(s.irq().eventfd().read().unwrap(), 1);
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b[0], b'x');
        // Wide accesses are ignored / read as ones.
        let mut w = [0u8; 2];
        s.read(0, &mut w);
        assert_eq!(w, [0xff, 0xff]);
    }
}

//! The 8250 UART at COM1 (0x3f8, IRQ 4), built on vm-superio.

use std::io::Write;

use vm_superio::serial::SerialEvents;
use vmm_sys_util::eventfd::EventFd;

use super::EventTrigger;
use crate::bus::BusDevice;

/// Base port of COM1.
pub const SERIAL_COM1_BASE: u64 = 0x3f8;
/// Number of ports the UART decodes.
pub const SERIAL_PORT_LEN: u64 = 8;
/// The legacy IRQ line of COM1.
pub const SERIAL_COM1_IRQ: u32 = 4;

/// IER bit: received-data interrupt enabled.
const IER_RDI: u8 = 1;
/// LCR bit: divisor latch access (offsets 0 and 1 address the divisor).
const LCR_DLAB: u8 = 0x80;
/// MCR bit: data terminal ready (raised by the driver once a tty has the port open).
const MCR_DTR: u8 = 0x01;
/// MCR bit: loopback (the driver's probe uses it; input must not arrive then).
const MCR_LOOP: u8 = 0x10;
/// LSR bit: data ready (the receive FIFO holds a byte).
const LSR_DATA_READY: u8 = 0x01;
/// Offsets of IER and MCR.
const OFF_IER: u8 = 1;
const OFF_MCR: u8 = 4;

/// Where guest console output goes.
pub type SerialOut = Box<dyn Write + Send>;

/// Signals the VMM when the guest has drained the receive FIFO, so more input can be queued.
#[derive(Debug)]
pub struct InputDrained(Option<EventFd>);

impl SerialEvents for InputDrained {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        if let Some(e) = &self.0 {
            let _ = e.write(1);
        }
    }
}

/// COM1: guest output goes to `out`, input is queued with [`Serial::enqueue_input`].
pub struct Serial {
    inner: vm_superio::Serial<EventTrigger, InputDrained, SerialOut>,
    /// Also written when the guest enables the receive interrupt (it is ready for input).
    input_ready: Option<EventFd>,
    /// Input the guest had not read when it stopped accepting input (a port closed, a
    /// console write masking interrupts): taken back out of the FIFO, because the driver
    /// discards what it finds there when it shuts down and starts up the port; the feeder
    /// sends it again first ([`Serial::take_back`]).
    taken_back: Vec<u8>,
}

impl std::fmt::Debug for Serial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serial").finish_non_exhaustive()
    }
}

impl Serial {
    /// A UART raising `irq` when it needs attention and writing guest output to `out`.
    pub fn new(irq: EventTrigger, out: SerialOut) -> Self {
        Self::with_input_events(irq, out, None)
    }

    /// Like [`Serial::new`], writing `drained` whenever the guest empties the receive FIFO.
    pub fn with_input_events(irq: EventTrigger, out: SerialOut, drained: Option<EventFd>) -> Self {
        let input_ready = drained.as_ref().and_then(|e| e.try_clone().ok());
        Self {
            inner: vm_superio::Serial::with_events(irq, InputDrained(drained), out),
            input_ready,
            taken_back: Vec::new(),
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

    /// Room left in the receive FIFO, or 0 while no tty has the port open.
    ///
    /// The 8250 driver reads (and discards) receive bytes while it probes, starts up and shuts
    /// down the port, and its probe briefly writes 0x0f to IER. Input therefore waits until the
    /// port is open for real: receive interrupt on, DTR raised (the tty layer raises it after
    /// start-up is complete) and not in loopback.
    pub fn input_capacity(&self) -> usize {
        if !self.accepting_input() {
            return 0;
        }
        self.inner.fifo_capacity()
    }

    /// Input taken back from the FIFO when the guest stopped accepting it, oldest first (to
    /// be queued again before anything newer).
    pub fn take_back(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.taken_back)
    }

    /// Whether a write of `value` at `off` stops the port accepting input.
    fn stops_input(&self, off: u8, value: u8) -> bool {
        if !self.accepting_input() {
            return false;
        }
        match off {
            OFF_IER => value & IER_RDI == 0,
            OFF_MCR => value & MCR_DTR == 0 || value & MCR_LOOP != 0,
            _ => false,
        }
    }

    fn accepting_input(&self) -> bool {
        let s = self.inner.state();
        s.interrupt_enable & IER_RDI != 0
            && s.modem_control & MCR_DTR != 0
            && s.modem_control & MCR_LOOP == 0
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
        drained: Option<EventFd>,
    ) -> std::io::Result<Self> {
        let input_ready = drained.as_ref().and_then(|e| e.try_clone().ok());
        let inner = vm_superio::Serial::from_state(state, irq, InputDrained(drained), out)
            .map_err(|e| std::io::Error::other(format!("serial state: {e:?}")))?;
        Ok(Self {
            inner,
            input_ready,
            taken_back: Vec::new(),
        })
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
            let dlab = self.inner.state().line_control & LCR_DLAB != 0;
            // Unread input leaves the FIFO before the guest stops taking it (with the
            // divisor latch off, offset 0 reads the receive buffer).
            if !dlab && self.stops_input(off, *b) {
                while self.inner.state().line_status & LSR_DATA_READY != 0 {
                    self.taken_back.push(self.inner.read(0));
                }
            }
            if let Err(e) = self.inner.write(off, *b) {
                crate::warn_limited!("serial write at offset {off}: {e:?}");
            }
            if ((off == OFF_IER && !dlab) || off == OFF_MCR) && self.accepting_input() {
                if let Some(e) = &self.input_ready {
                    let _ = e.write(1);
                }
            }
        }
    }
}

/// The UART's registers (mirror of vm-superio's `SerialState`, which has no serde).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialSnapshot {
    /// Divisor latch low.
    pub baud_divisor_low: u8,
    /// Divisor latch high.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// Scratch.
    pub scratch: u8,
    /// Bytes the guest has not read yet.
    pub in_buffer: Vec<u8>,
}

impl From<vm_superio::serial::SerialState> for SerialSnapshot {
    fn from(s: vm_superio::serial::SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialSnapshot> for vm_superio::serial::SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            // A hostile state file cannot make the FIFO larger than the UART's.
            in_buffer: s.in_buffer.iter().copied().take(64).collect(),
        }
    }
}

impl Serial {
    /// Register state for a snapshot.
    pub fn snapshot(&self) -> SerialSnapshot {
        self.inner.state().into()
    }

    /// Rebuilds the UART from a snapshot.
    pub fn from_snapshot(
        s: &SerialSnapshot,
        irq: EventTrigger,
        out: SerialOut,
        drained: Option<EventFd>,
    ) -> std::io::Result<Self> {
        Self::from_state(&s.into(), irq, out, drained)
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
        // Open the port (receive interrupt, DTR), queue a byte, read it back.
        s.write(1, &[1]);
        s.write(4, &[0x0b]);
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

    #[test]
    fn input_waits_while_the_driver_probes_starts_or_closes_the_port() {
        let ready = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut s = Serial::with_input_events(
            EventTrigger::new().unwrap(),
            Box::new(std::io::sink()),
            Some(ready.try_clone().unwrap()),
        );
        assert_eq!(s.input_capacity(), 0, "power-on: port closed");
        // The probe writes 0x0f to IER, with loopback on.
        s.write(4, &[0x1a]);
        s.write(1, &[0x0f]);
        assert_eq!(s.input_capacity(), 0, "probe: loopback, no DTR");
        s.write(1, &[0]);
        s.write(4, &[0x08]);
        // Start-up turns the receive interrupt on before the tty raises DTR.
        s.write(1, &[0x05]);
        assert_eq!(s.input_capacity(), 0, "start-up: DTR still low");
        assert!(ready.read().is_err(), "no readiness signalled yet");
        s.write(4, &[0x0b]);
        assert_eq!(s.input_capacity(), 64);
        assert_eq!(ready.read().unwrap(), 1, "DTR raised: input may flow");
        // Close: DTR dropped, interrupts off.
        s.write(4, &[0x08]);
        assert_eq!(s.input_capacity(), 0);
    }

    #[test]
    fn unread_input_is_taken_back_when_the_port_stops_taking_it() {
        let mut s = Serial::new(EventTrigger::new().unwrap(), Box::new(std::io::sink()));
        s.write(1, &[0x05]);
        s.write(4, &[0x0b]);
        assert_eq!(s.enqueue_input(b"hello").unwrap(), 5);
        let mut b = [0u8];
        s.read(0, &mut b);
        assert_eq!(b[0], b'h');
        // A console write masks the interrupts: the rest comes back out, in order.
        s.write(1, &[0]);
        assert_eq!(s.take_back(), b"ello");
        assert!(s.take_back().is_empty());
        s.read(5, &mut b);
        assert_eq!(b[0] & LSR_DATA_READY, 0, "the FIFO is empty");
        // Re-opened, the same bytes can be queued again; a close by DTR takes them back too.
        s.write(1, &[0x05]);
        s.enqueue_input(b"ello").unwrap();
        s.write(4, &[0x08]);
        assert_eq!(s.take_back(), b"ello");
        // Writes that keep the port open take nothing.
        s.write(4, &[0x0b]);
        s.enqueue_input(b"x").unwrap();
        s.write(1, &[0x07]);
        assert!(s.take_back().is_empty());
    }

    #[test]
    fn snapshot_round_trip_keeps_registers_and_pending_input() {
        let mut s = Serial::new(EventTrigger::new().unwrap(), Box::new(std::io::sink()));
        s.write(7, &[0x5a]); // scratch
        s.write(1, &[1]);
        s.write(4, &[0x0b]);
        s.enqueue_input(b"ab").unwrap();
        let snap = s.snapshot();
        let mut r = Serial::from_snapshot(
            &snap,
            EventTrigger::new().unwrap(),
            Box::new(std::io::sink()),
            None,
        )
        .unwrap();
        let mut b = [0u8];
        r.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        r.read(0, &mut b);
        assert_eq!(b[0], b'a');
        // A hostile snapshot cannot overfill the FIFO.
        let mut big = snap.clone();
        big.in_buffer = vec![0; 100_000];
        let r = Serial::from_snapshot(
            &big,
            EventTrigger::new().unwrap(),
            Box::new(std::io::sink()),
            None,
        )
        .unwrap();
        assert!(r.snapshot().in_buffer.len() <= 64);
    }
}

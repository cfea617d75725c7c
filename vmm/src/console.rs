//! Console input: bytes from the VMM's stdin go into COM1's receive FIFO.
//!
//! The UART's FIFO holds 64 bytes. Input waits in a bounded buffer here; when it is full the
//! VMM stops reading stdin, and when the guest drains the FIFO (the UART signals an eventfd)
//! more is queued. Nothing is dropped and nothing blocks the event loop: input the guest had
//! not read when it stopped taking input (its driver discards the FIFO when it closes and
//! opens the port) is taken back by the UART and sent again first.

use std::collections::VecDeque;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use ember_devices::bus::lock;
use ember_devices::legacy::Serial;
use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

/// Most input bytes held back while the guest is not reading.
pub const MAX_PENDING: usize = 64 * 1024;

/// Forwards a readable fd (normally stdin) to the UART.
#[derive(Debug)]
pub struct SerialInput {
    serial: Arc<Mutex<Serial>>,
    input: RawFd,
    drained: EventFd,
    pending: VecDeque<u8>,
    reading: bool,
    eof: bool,
}

impl SerialInput {
    /// Forwards `input` (made non-blocking) to `serial`; `drained` is the UART's FIFO-empty
    /// eventfd.
    pub fn new(
        serial: Arc<Mutex<Serial>>,
        input: RawFd,
        drained: EventFd,
    ) -> std::io::Result<Self> {
        // SAFETY: F_GETFL/F_SETFL on a descriptor we were handed; no memory is involved.
        let flags = unsafe { libc::fcntl(input, libc::F_GETFL) };
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(input, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            serial,
            input,
            drained,
            pending: VecDeque::new(),
            reading: true,
            eof: false,
        })
    }

    fn flush(&mut self) {
        let mut s = lock(&self.serial);
        // What the guest had not read when it closed the port (or masked its interrupts)
        // goes again before anything newer.
        for b in s.take_back().into_iter().rev() {
            self.pending.push_front(b);
        }
        if self.pending.is_empty() {
            return;
        }
        let (a, _) = self.pending.as_slices();
        let n = a.len().min(s.input_capacity());
        if n == 0 {
            return;
        }
        let chunk: Vec<u8> = self.pending.iter().take(n).copied().collect();
        match s.enqueue_input(&chunk) {
            Ok(k) => {
                self.pending.drain(..k);
            }
            Err(e) => ember_devices::warn_limited!("console input: {e}"),
        }
    }

    fn read_input(&mut self) {
        let mut buf = [0u8; 4096];
        while self.pending.len() < MAX_PENDING {
            let want = buf.len().min(MAX_PENDING - self.pending.len());
            // SAFETY: reading into a stack buffer of at least `want` bytes.
            let n = unsafe { libc::read(self.input, buf.as_mut_ptr().cast(), want) };
            if n > 0 {
                self.pending.extend(&buf[..n as usize]);
            } else if n == 0 {
                self.eof = true;
                break;
            } else {
                break; // EAGAIN or an error: wait for the next event.
            }
        }
    }

    fn input_events(&self) -> Events {
        Events::with_data_raw(self.input, 0, EventSet::IN | EventSet::READ_HANG_UP)
    }
}

impl MutEventSubscriber for SerialInput {
    fn init(&mut self, ops: &mut EventOps) {
        if ops.add(self.input_events()).is_err() {
            tracing::warn!("console input: cannot watch the input (not pollable?)");
            self.reading = false;
        }
        if let Err(e) = ops.add(Events::with_data(&self.drained, 1, EventSet::IN)) {
            tracing::warn!("console input: cannot watch the UART: {e:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        if events.fd() == self.drained.as_raw_fd() {
            let _ = self.drained.read();
        } else {
            self.read_input();
        }
        self.flush();
        let want_reading = !self.eof && self.pending.len() < MAX_PENDING;
        if want_reading != self.reading {
            let r = if want_reading {
                ops.add(self.input_events())
            } else {
                ops.remove(self.input_events())
            };
            if r.is_ok() {
                self.reading = want_reading;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_devices::legacy::EventTrigger;
    use std::io::Write;

    #[test]
    fn input_reaches_the_fifo_and_waits_while_it_is_full() {
        let drained = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let serial = Arc::new(Mutex::new(Serial::with_input_events(
            EventTrigger::new().unwrap(),
            Box::new(std::io::sink()),
            Some(drained.try_clone().unwrap()),
        )));
        let (rx, mut tx) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut input = SerialInput::new(serial.clone(), rx.as_raw_fd(), drained).unwrap();
        let data: Vec<u8> = (0..200u8).collect();
        tx.write_all(&data).unwrap();
        input.read_input();
        input.flush();
        // The guest driver has not opened the port yet: nothing is queued.
        assert_eq!(input.pending.len(), 200);
        {
            use ember_devices::bus::BusDevice;
            let mut s = serial.lock().unwrap();
            s.write(1, &[1]); // receive interrupt on
            s.write(4, &[0x0b]); // DTR, RTS, OUT2: a tty has the port open
        }
        assert!(
            input.drained.read().unwrap() >= 1,
            "opening the port signals readiness"
        );
        input.flush();
        // 64 bytes fit the FIFO, the rest waits.
        assert_eq!(input.pending.len(), 200 - 64);
        let mut got = Vec::new();
        let mut b = [0u8];
        while got.len() < 200 {
            use ember_devices::bus::BusDevice;
            // Line status bit 0: data ready.
            let mut lsr = [0u8];
            serial.lock().unwrap().read(5, &mut lsr);
            if lsr[0] & 1 == 0 {
                input.flush();
                continue;
            }
            serial.lock().unwrap().read(0, &mut b);
            got.push(b[0]);
        }
        assert_eq!(got, data);
        drop(rx);
    }
}

//! Just enough of the i8042 keyboard controller for the guest to reset the machine
//! (`reboot=k`: command 0xFE on port 0x64). The VMM turns the reset into a clean exit.

use super::EventTrigger;
use crate::bus::BusDevice;

/// First port the controller decodes (data port 0x60; command/status is 0x64).
pub const I8042_PORT_BASE: u64 = 0x60;
/// Ports 0x60..=0x64.
pub const I8042_PORT_LEN: u64 = 5;

/// The reset half of an i8042.
pub struct I8042 {
    inner: vm_superio::I8042Device<EventTrigger>,
}

impl std::fmt::Debug for I8042 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("I8042").finish_non_exhaustive()
    }
}

impl I8042 {
    /// A controller that writes `reset` when the guest asks for a CPU reset.
    pub fn new(reset: EventTrigger) -> Self {
        Self {
            inner: vm_superio::I8042Device::new(reset),
        }
    }

    /// The reset eventfd.
    pub fn reset_event(&self) -> &EventTrigger {
        self.inner.reset_evt()
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (u8::try_from(offset), data) {
            (Ok(off), [b]) => *b = self.inner.read(off),
            (_, data) => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), [b]) = (u8::try_from(offset), data) {
            if let Err(e) = self.inner.write(off, *b) {
                crate::error_limited!("i8042: cannot signal the reset: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_fires_the_event_and_nothing_else_does() {
        let mut dev = I8042::new(EventTrigger::new().unwrap());
        dev.write(0, &[0xfe]);
        dev.write(4, &[0xfd]);
        dev.write(4, &[0xfe, 0]);
        assert!(dev.reset_event().eventfd().read().is_err(), "no reset yet");
        dev.write(4, &[0xfe]);
        assert_eq!(dev.reset_event().eventfd().read().unwrap(), 1);
        let mut status = [0xffu8];
        dev.read(4, &mut status);
        assert_eq!(status[0], 0, "status reads as input/output buffers empty");
    }
}

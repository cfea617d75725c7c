//! Raw terminal mode for the interactive console.

/// Puts stdin's terminal in raw mode; restores it on drop. A no-op when stdin is no terminal.
#[derive(Debug)]
pub struct RawTerminal {
    saved: Option<libc::termios>,
}

impl RawTerminal {
    /// Enters raw mode if stdin is a terminal.
    pub fn enter() -> Self {
        // SAFETY: isatty has no memory-safety preconditions.
        if unsafe { libc::isatty(0) } != 1 {
            return Self { saved: None };
        }
        // SAFETY: termios is plain old data; all-zero is a valid value to fill in.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `t` is a valid, writable termios.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return Self { saved: None };
        }
        let saved = t;
        // SAFETY: `t` is a valid termios obtained above.
        unsafe { libc::cfmakeraw(&mut t) };
        // Keep output post-processing so "\n" from the guest still starts a new line.
        t.c_oflag |= libc::OPOST;
        // SAFETY: `t` is a valid termios.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        Self { saved: Some(saved) }
    }

    /// Restores the saved mode now.
    pub fn restore(&mut self) {
        if let Some(t) = self.saved.take() {
            // SAFETY: `t` is the termios read from this terminal by `enter`.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        self.restore();
    }
}

/// The detach key: Ctrl-].
pub const DETACH: u8 = 0x1d;

/// Splits input at the detach key: the bytes to forward, and whether the key was pressed.
pub fn split_detach(buf: &[u8]) -> (&[u8], bool) {
    match buf.iter().position(|&b| b == DETACH) {
        Some(i) => (&buf[..i], true),
        None => (buf, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detach_key_stops_forwarding() {
        assert_eq!(split_detach(b"ls\r"), (&b"ls\r"[..], false));
        assert_eq!(split_detach(b"ab\x1dcd"), (&b"ab"[..], true));
        let t = RawTerminal::enter(); // not a tty under test: no-op
        drop(t);
    }
}

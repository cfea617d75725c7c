//! Cancelling a long call from outside it: [`Cancel`].
//!
//! A call that streams for as long as something lives (a process attach, a directory watch)
//! blocks in a read on its agent connection; an event sink that returns `false` cannot stop
//! it while the guest says nothing. A [`Cancel`] handed in through [`crate::call::Io`] can:
//! firing it shuts the call's connection down, so the blocking read ends at once. The
//! runtime also fires the cancels of a sandbox's open streams before it pauses or kills it,
//! so a stream never holds a pause up.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// Stops a long call from another thread (a client that went away, a pause).
#[derive(Debug, Default)]
pub struct Cancel {
    inner: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    conn: Option<UnixStream>,
    fired: bool,
}

impl Cancel {
    /// A new, unfired cancel.
    pub fn new() -> Arc<Cancel> {
        Arc::new(Cancel::default())
    }

    /// Registers the call's connection (a clone of it). False when already fired: do not
    /// start the call.
    pub(crate) fn arm(&self, conn: &UnixStream) -> bool {
        let mut s = lock(&self.inner);
        if s.fired {
            return false;
        }
        s.conn = conn.try_clone().ok();
        true
    }

    /// Unregisters the connection after the call; true when the cancel fired meanwhile (the
    /// connection was shut down and must not be reused).
    pub(crate) fn disarm(&self) -> bool {
        let mut s = lock(&self.inner);
        s.conn = None;
        s.fired
    }

    /// Stops the call (now, or as soon as it is armed).
    pub fn fire(&self) {
        let mut s = lock(&self.inner);
        s.fired = true;
        if let Some(c) = s.conn.take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Whether it fired.
    pub fn fired(&self) -> bool {
        lock(&self.inner).fired
    }
}

/// Fires a [`Cancel`] when dropped (held by a response body: the client went away, or the
/// stream ended).
#[derive(Debug)]
pub struct CancelOnDrop(pub Arc<Cancel>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.fire();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn firing_ends_a_blocked_read_and_a_fired_cancel_refuses_to_arm() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let c = Cancel::new();
        assert!(c.arm(&a));
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 8];
            b.read(&mut buf).unwrap()
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        c2.fire();
        // The peer sees the shut-down connection's end of file.
        assert_eq!(t.join().unwrap(), 0);
        assert!(c.disarm(), "the cancel fired while armed");
        assert!(c.fired());
        let (x, _y) = UnixStream::pair().unwrap();
        assert!(!c.arm(&x), "a fired cancel must not arm again");
    }

    #[test]
    fn dropping_the_guard_fires() {
        let c = Cancel::new();
        drop(CancelOnDrop(c.clone()));
        assert!(c.fired());
    }
}

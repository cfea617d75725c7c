//! Admission of VM starts: at most N guests between "vCPUs start" and "agent answered".
//!
//! A restored guest's first moments are its most expensive: it handles the vsock transport
//! reset, wakes its agent, answers the handshake and `sync`. That work is guest CPU, and the
//! runtime retries a handshake that races with the reset. With many starts at once (64
//! concurrent creates on a 2-core host) every guest gets a sliver of CPU, each one's retries
//! cost it more work, and no create finishes before its deadline: throughput collapses to
//! zero. Admitting a few starts at a time keeps each one short, so creates complete at the
//! rate the host can sustain and the rest wait in line (their wait is reported as
//! `queued_ms` in the create's audit record).
//!
//! A plain counting semaphore (Mutex + Condvar): FIFO is not guaranteed, but waiting is
//! bounded by the caller's deadline.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The default limit: two starts per host CPU (one running while another waits on I/O).
pub fn default_limit() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get() * 2)
        .unwrap_or(4)
        .max(2)
}

/// A counting semaphore for VM starts.
#[derive(Debug)]
pub struct StartGate {
    limit: usize,
    busy: Mutex<usize>,
    cv: Condvar,
}

/// A held admission; released on drop.
#[derive(Debug)]
pub struct Admitted<'a> {
    gate: &'a StartGate,
    /// How long the caller waited for it.
    pub waited: Duration,
}

impl StartGate {
    /// A gate admitting `limit` starts at once (0: no limit).
    pub fn new(limit: usize) -> StartGate {
        StartGate {
            limit,
            busy: Mutex::new(0),
            cv: Condvar::new(),
        }
    }

    /// Waits until a start may begin, or `timeout` passes (`None` then).
    pub fn admit(&self, timeout: Duration) -> Option<Admitted<'_>> {
        let t0 = Instant::now();
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while self.limit > 0 && *busy >= self.limit {
            let left = timeout.checked_sub(t0.elapsed())?;
            if left.is_zero() {
                return None;
            }
            busy = self
                .cv
                .wait_timeout(busy, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *busy += 1;
        Some(Admitted {
            gate: self,
            waited: t0.elapsed(),
        })
    }

    /// Starts under way.
    pub fn busy(&self) -> usize {
        *self.busy.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut busy = self.gate.busy.lock().unwrap_or_else(|p| p.into_inner());
        *busy = busy.saturating_sub(1);
        drop(busy);
        self.gate.cv.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn never_more_than_the_limit_at_once() {
        let gate = Arc::new(StartGate::new(3));
        let now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..12)
            .map(|_| {
                let (gate, now, peak) = (gate.clone(), now.clone(), peak.clone());
                std::thread::spawn(move || {
                    let _a = gate.admit(Duration::from_secs(30)).expect("admitted");
                    let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(n, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    now.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        assert_eq!(gate.busy(), 0);
    }

    #[test]
    fn a_full_gate_times_out_and_a_release_admits_the_next() {
        let gate = StartGate::new(1);
        let first = gate
            .admit(Duration::ZERO)
            .expect("free gate admits at once");
        let t = Instant::now();
        assert!(gate.admit(Duration::from_millis(50)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(50));
        drop(first);
        let second = gate.admit(Duration::ZERO).expect("released");
        assert!(second.waited < Duration::from_secs(1));
    }

    #[test]
    fn zero_means_no_limit() {
        let gate = StartGate::new(0);
        let held: Vec<_> = (0..100)
            .map(|_| gate.admit(Duration::ZERO).expect("no limit"))
            .collect();
        assert_eq!(gate.busy(), 100);
        drop(held);
        assert_eq!(gate.busy(), 0);
        assert!(default_limit() >= 2);
    }
}

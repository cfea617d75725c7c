//! The VMM watchdog: an opt-in dead man's switch driven over the control socket
//! (`{"op":"watchdog","timeout_ms":N}`, [`crate::api::Request::Watchdog`]).
//!
//! The process that owns a VMM (a fleet node's runtime) may freeze — stopped by `SIGSTOP`, or a
//! hung host process — while its VMs run on. With the watchdog armed, each VMM pauses its own
//! vCPUs when its owner has not been heard from for `timeout_ms`, so that a VM whose owner froze
//! stops acting while the fleet moves or kills the sandbox elsewhere.
//!
//! This module is the state machine only (a leaf: it uses no other module of the crate). The
//! running VM ([`crate::vm`]) owns one [`Watchdog`], sleeps in its event loop no longer than
//! [`Watchdog::wait_ms`], asks [`Watchdog::poll_expired`] after each iteration (after the
//! control requests of that iteration, so a keep-alive that arrives with the deadline wins),
//! and does the pausing and resuming itself.
//!
//! Rules:
//! - every `watchdog` request is a keep-alive: the deadline becomes now + `timeout_ms`
//!   (`timeout_ms` > 0 arms or re-arms with that period; 0 disarms). A request out of bounds
//!   ([`MIN_TIMEOUT_MS`]..=[`MAX_TIMEOUT_MS`]) is refused and changes nothing;
//! - a deadline expires once: it counts one expiry; if the VM is running, the VM pauses it
//!   and marks the pause as the watchdog's; a VM already paused deliberately stays as it is,
//!   unmarked. The watchdog then waits for the next keep-alive (it does not wake again);
//! - a keep-alive (arming or disarming) while the VM is paused by the watchdog resumes it;
//! - an explicit `pause` or `snapshot` clears the mark, so a later keep-alive does not resume a
//!   VM someone paused deliberately; an explicit `resume` clears it too and, if the watchdog is
//!   armed and its deadline has already expired, starts a new period (the VM never runs with
//!   an armed watchdog and no deadline);
//! - if pausing fails, the watchdog tries again one period later.
//!
//! The watchdog is run-time state: it is not saved in snapshots, and a restored VM starts
//! with it disarmed.

use std::time::{Duration, Instant};

/// Shortest period accepted (ms): shorter ones would pause VMs on ordinary scheduling hiccups
/// of a busy host, and bound how often an expiry can be logged.
pub const MIN_TIMEOUT_MS: u64 = 100;
/// Longest period accepted (ms): one hour.
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;

/// A refused `watchdog` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WatchdogError {
    /// `timeout_ms` is neither 0 nor within the bounds.
    #[error(
        "watchdog timeout_ms {0} is out of bounds: 0 disarms, otherwise it must be between \
         {MIN_TIMEOUT_MS} and {MAX_TIMEOUT_MS} (100 ms to 1 h)"
    )]
    OutOfBounds(u64),
}

/// The period a `timeout_ms` asks for: `None` to disarm.
pub fn period(timeout_ms: u64) -> Result<Option<Duration>, WatchdogError> {
    match timeout_ms {
        0 => Ok(None),
        MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS => Ok(Some(Duration::from_millis(timeout_ms))),
        _ => Err(WatchdogError::OutOfBounds(timeout_ms)),
    }
}

/// The watchdog of one running VM (disarmed by default).
#[derive(Debug, Default)]
pub struct Watchdog {
    /// The period while armed.
    period: Option<Duration>,
    /// The pending deadline: `None` while disarmed and once it has expired.
    deadline: Option<Instant>,
    /// The VM is paused, and the watchdog paused it.
    paused_vm: bool,
    /// Deadlines that expired without a keep-alive.
    expiries: u64,
    /// Pausing failed at the last expiry (to log a run of failures once).
    pause_failing: bool,
}

impl Watchdog {
    /// A keep-alive with `timeout_ms` at `now`: arms (or re-arms) or disarms. Returns whether
    /// the VM is paused by the watchdog — the caller resumes it (the mark is cleared here).
    /// A refused request changes nothing.
    pub fn keep_alive(&mut self, timeout_ms: u64, now: Instant) -> Result<bool, WatchdogError> {
        let period = period(timeout_ms)?;
        self.period = period;
        self.deadline = period.map(|p| now + p);
        self.pause_failing = false;
        Ok(std::mem::take(&mut self.paused_vm))
    }

    /// How long the event loop may sleep at `now`, in ms for `epoll_wait`: -1 (no limit) when
    /// no deadline is pending, else the time left rounded up (so the loop does not wake just
    /// before the deadline and spin), 0 once it has passed.
    pub fn wait_ms(&self, now: Instant) -> i32 {
        let Some(deadline) = self.deadline else {
            return -1;
        };
        let left = deadline.saturating_duration_since(now);
        let ms = left.as_nanos().div_ceil(1_000_000);
        i32::try_from(ms).unwrap_or(i32::MAX)
    }

    /// True once per deadline, when it has passed at `now`: counts an expiry. The caller then
    /// pauses the VM (unless it already is) and calls [`Watchdog::paused_vm`] or
    /// [`Watchdog::pause_failed`].
    pub fn poll_expired(&mut self, now: Instant) -> bool {
        match self.deadline {
            Some(d) if now >= d => {
                self.deadline = None;
                self.expiries += 1;
                true
            }
            _ => false,
        }
    }

    /// The VM was paused by this watchdog's expiry.
    pub fn paused_vm(&mut self) {
        self.paused_vm = true;
        self.pause_failing = false;
    }

    /// Pausing the VM at an expiry failed at `now`: tries again one period later. Returns
    /// whether this is the first failure in a row (to log a run of failures once).
    pub fn pause_failed(&mut self, now: Instant) -> bool {
        self.deadline = self.period.map(|p| now + p);
        !std::mem::replace(&mut self.pause_failing, true)
    }

    /// The VM was paused deliberately (a `pause` or `snapshot` request): a later keep-alive
    /// must not resume it.
    pub fn deliberately_paused(&mut self) {
        self.paused_vm = false;
    }

    /// The VM was resumed deliberately (a `resume` request) at `now`. If the watchdog is armed
    /// and its deadline has expired, a new period starts.
    pub fn deliberately_resumed(&mut self, now: Instant) {
        self.paused_vm = false;
        if self.deadline.is_none() {
            self.deadline = self.period.map(|p| now + p);
        }
    }

    /// The period in ms while armed.
    pub fn armed_ms(&self) -> Option<u64> {
        self.period.map(|p| p.as_millis() as u64)
    }

    /// Whether the VM is paused by the watchdog.
    pub fn paused_by_watchdog(&self) -> bool {
        self.paused_vm
    }

    /// Deadlines that expired without a keep-alive so far.
    pub fn expiries(&self) -> u64 {
        self.expiries
    }

    /// The `watchdog` object of the `stats` reply.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "armed_ms": self.armed_ms(),
            "paused_by_watchdog": self.paused_vm,
            "expiries": self.expiries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn bounds() {
        assert_eq!(period(0), Ok(None));
        assert_eq!(period(100), Ok(Some(100 * MS)));
        assert_eq!(period(3_600_000), Ok(Some(Duration::from_secs(3600))));
        for bad in [1, 99, 3_600_001, u64::MAX] {
            let e = period(bad).unwrap_err();
            assert_eq!(e, WatchdogError::OutOfBounds(bad));
            let text = e.to_string();
            assert!(
                text.contains("100") && text.contains("3600000") && text.contains("0 disarms"),
                "{text}"
            );
        }
    }

    #[test]
    fn disarmed_by_default_and_never_expires() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        assert_eq!(w.wait_ms(t), -1);
        assert!(!w.poll_expired(t + Duration::from_secs(7200)));
        assert_eq!(
            w.to_json(),
            serde_json::json!({"armed_ms": null, "paused_by_watchdog": false, "expiries": 0})
        );
    }

    #[test]
    fn a_deadline_expires_once_and_a_keep_alive_resumes() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        assert_eq!(w.keep_alive(1000, t), Ok(false));
        assert_eq!(w.armed_ms(), Some(1000));
        assert_eq!(w.wait_ms(t), 1000);
        // Rounded up: the loop never wakes before the deadline.
        assert_eq!(w.wait_ms(t + Duration::from_micros(1500)), 999);
        // Keep-alives push the deadline.
        assert_eq!(w.keep_alive(1000, t + 600 * MS), Ok(false));
        assert!(!w.poll_expired(t + 1599 * MS));
        assert!(w.poll_expired(t + 1600 * MS));
        assert_eq!(w.expiries(), 1);
        // Once per deadline; no more wake-ups until the next keep-alive.
        assert!(!w.poll_expired(t + Duration::from_secs(60)));
        assert_eq!(w.wait_ms(t + 1600 * MS), -1);
        w.paused_vm();
        assert!(w.paused_by_watchdog());
        assert_eq!(w.to_json()["paused_by_watchdog"], true);
        // The next keep-alive says "resume" once and re-arms.
        assert_eq!(w.keep_alive(1000, t + 2000 * MS), Ok(true));
        assert!(!w.paused_by_watchdog());
        assert_eq!(w.keep_alive(1000, t + 2100 * MS), Ok(false));
        assert!(w.poll_expired(t + 3100 * MS));
        assert_eq!(w.expiries(), 2);
    }

    #[test]
    fn a_deliberate_pause_is_not_undone_by_a_keep_alive() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        w.keep_alive(100, t).unwrap();
        assert!(w.poll_expired(t + 100 * MS));
        w.paused_vm();
        w.deliberately_paused();
        assert_eq!(w.keep_alive(100, t + 150 * MS), Ok(false));
    }

    #[test]
    fn a_deliberate_resume_restarts_an_expired_period() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        w.keep_alive(500, t).unwrap();
        // Expired while the VM was deliberately paused: counted, not marked.
        assert!(w.poll_expired(t + 500 * MS));
        assert!(!w.paused_by_watchdog());
        w.deliberately_resumed(t + 800 * MS);
        assert_eq!(w.wait_ms(t + 800 * MS), 500);
        // A resume within a period leaves the deadline alone.
        w.deliberately_resumed(t + 900 * MS);
        assert_eq!(w.wait_ms(t + 900 * MS), 400);
        // Disarmed, a resume arms nothing.
        w.keep_alive(0, t + 1000 * MS).unwrap();
        w.deliberately_resumed(t + 1000 * MS);
        assert_eq!(w.wait_ms(t + 1000 * MS), -1);
    }

    #[test]
    fn disarming_resumes_and_stops_expiries() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        w.keep_alive(100, t).unwrap();
        assert!(w.poll_expired(t + 100 * MS));
        w.paused_vm();
        assert_eq!(w.keep_alive(0, t + 200 * MS), Ok(true));
        assert_eq!(w.armed_ms(), None);
        assert!(!w.poll_expired(t + Duration::from_secs(3600)));
        assert_eq!(w.expiries(), 1);
    }

    #[test]
    fn a_refused_request_changes_nothing() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        w.keep_alive(1000, t).unwrap();
        assert!(w.poll_expired(t + 1000 * MS));
        w.paused_vm();
        assert_eq!(
            w.keep_alive(50, t + 1100 * MS),
            Err(WatchdogError::OutOfBounds(50))
        );
        assert!(w.paused_by_watchdog());
        assert_eq!(w.armed_ms(), Some(1000));
    }

    #[test]
    fn a_failed_pause_is_retried_a_period_later_and_logged_once() {
        let t = Instant::now();
        let mut w = Watchdog::default();
        w.keep_alive(200, t).unwrap();
        assert!(w.poll_expired(t + 200 * MS));
        assert!(w.pause_failed(t + 200 * MS));
        assert_eq!(w.wait_ms(t + 200 * MS), 200);
        assert!(w.poll_expired(t + 400 * MS));
        assert!(!w.pause_failed(t + 400 * MS));
        assert!(w.poll_expired(t + 600 * MS));
        w.paused_vm();
        assert_eq!(w.expiries(), 3);
        assert_eq!(w.wait_ms(t + 600 * MS), -1);
    }
}

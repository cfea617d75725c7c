//! Rate limiting for log lines a guest can trigger.
//!
//! A guest that repeats a malformed request, breaks a queue over and over or writes a bad
//! register in a loop must not be able to fill the host's log (or disk) or slow the VMM down
//! with logging. Every log line whose cause a guest controls goes through
//! [`warn_limited!`](crate::warn_limited), [`error_limited!`](crate::error_limited),
//! [`info_limited!`](crate::info_limited) or [`debug_limited!`](crate::debug_limited) instead
//! of the `tracing` macro of the same level.
//!
//! # Policy
//! Each **call site** (each use of one of the macros) has its own budget, shared by every
//! thread and every device instance that reaches it:
//! - a burst of [`BURST`] (10) lines, then
//! - one more line per [`REFILL_INTERVAL`] (5 s), the budget refilling continuously up to the
//!   burst again (after 50 s of quiet the full burst is available).
//!
//! Lines beyond the budget are dropped and counted. The next line the site does log is
//! preceded, at the same level, by `<file>:<line>: N similar messages suppressed`, so the log
//! says how many were lost and where. A site that stays over budget therefore logs at most one
//! line plus one count line per 5 s.
//!
//! The check is the generic cell rate algorithm on one atomic (the site's "theoretical
//! arrival time" in nanoseconds) plus an atomic counter of dropped lines: no lock, no
//! allocation, no system call beyond reading the monotonic clock (vDSO). It runs on vCPU
//! threads and on the event loop and never blocks. A site whose level is disabled by the log
//! filter costs only tracing's own `enabled` check and consumes no budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[doc(hidden)]
pub use tracing as __tracing;

/// Lines a call site may log back to back before it is limited.
pub const BURST: u64 = 10;
/// After the burst, a call site may log one line per interval.
pub const REFILL_INTERVAL: Duration = Duration::from_secs(5);

const INTERVAL_NS: u64 = REFILL_INTERVAL.as_nanos() as u64;
const BURST_NS: u64 = BURST * INTERVAL_NS;

/// The budget of one call site (see the module docs for the policy).
#[derive(Debug)]
pub struct RateLimiter {
    /// GCRA's theoretical arrival time: the limiter clock's value at which the budget would be
    /// full again, plus one interval per line since. A line may go out while this stays within
    /// `BURST` intervals of now.
    tat: AtomicU64,
    /// Lines dropped since the last one that went out.
    suppressed: AtomicU64,
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new()
    }
}

impl RateLimiter {
    /// A limiter with its full burst available.
    pub const fn new() -> Self {
        Self {
            tat: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be logged now: `Some(n)` with the number of lines dropped since the
    /// previous one that went out (to be reported), or `None` (the line is dropped and
    /// counted).
    pub fn check(&self) -> Option<u64> {
        self.check_at(now_ns())
    }

    /// [`RateLimiter::check`] at `now` nanoseconds of a monotonic clock.
    pub fn check_at(&self, now: u64) -> Option<u64> {
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now).saturating_add(INTERVAL_NS);
            if next - now > BURST_NS {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            match self
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(self.suppressed.swap(0, Ordering::Relaxed)),
                Err(current) => tat = current,
            }
        }
    }
}

/// The limiter clock: nanoseconds of the monotonic clock since its first use in this process.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let since = EPOCH.get_or_init(Instant::now).elapsed();
    u64::try_from(since.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(test_clock::skew_ns())
}

/// Lets a unit test move the limiter clock forward on its own thread, so that refills can be
/// tested without sleeping and without disturbing tests on other threads.
#[cfg(test)]
pub(crate) mod test_clock {
    use std::cell::Cell;
    use std::time::Duration;

    thread_local! {
        static SKEW_NS: Cell<u64> = const { Cell::new(0) };
    }

    pub(crate) fn skew_ns() -> u64 {
        SKEW_NS.with(Cell::get)
    }

    /// Moves this thread's view of the limiter clock forward by `by`.
    pub(crate) fn advance(by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        SKEW_NS.with(|s| s.set(s.get().saturating_add(by)));
    }
}

#[cfg(not(test))]
mod test_clock {
    #[inline(always)]
    pub(super) fn skew_ns() -> u64 {
        0
    }
}

/// A rate-limited `tracing` event at `$lvl` (see the module docs). Use the level macros.
#[doc(hidden)]
#[macro_export]
macro_rules! __log_limited {
    ($lvl:expr, $($arg:tt)+) => {{
        if $crate::ratelimit::__tracing::enabled!($lvl) {
            static LIMITER: $crate::ratelimit::RateLimiter = $crate::ratelimit::RateLimiter::new();
            if let ::core::option::Option::Some(suppressed) = LIMITER.check() {
                if suppressed > 0 {
                    $crate::ratelimit::__tracing::event!(
                        $lvl,
                        "{}: {} similar messages suppressed",
                        ::core::concat!(::core::file!(), ":", ::core::line!()),
                        suppressed
                    );
                }
                $crate::ratelimit::__tracing::event!($lvl, $($arg)+);
            }
        }
    }};
}

/// `tracing::error!` with a per-call-site rate limit (see [`crate::ratelimit`]).
#[macro_export]
macro_rules! error_limited {
    ($($arg:tt)+) => {
        $crate::__log_limited!($crate::ratelimit::__tracing::Level::ERROR, $($arg)+)
    };
}

/// `tracing::warn!` with a per-call-site rate limit (see [`crate::ratelimit`]).
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {
        $crate::__log_limited!($crate::ratelimit::__tracing::Level::WARN, $($arg)+)
    };
}

/// `tracing::info!` with a per-call-site rate limit (see [`crate::ratelimit`]).
#[macro_export]
macro_rules! info_limited {
    ($($arg:tt)+) => {
        $crate::__log_limited!($crate::ratelimit::__tracing::Level::INFO, $($arg)+)
    };
}

/// `tracing::debug!` with a per-call-site rate limit (see [`crate::ratelimit`]).
#[macro_export]
macro_rules! debug_limited {
    ($($arg:tt)+) => {
        $crate::__log_limited!($crate::ratelimit::__tracing::Level::DEBUG, $($arg)+)
    };
}

/// A `tracing` subscriber for unit tests that keeps every event's level and message.
#[cfg(test)]
pub(crate) mod capture {
    use std::fmt::Write as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Level, Metadata, Subscriber};

    /// One captured line: its level and its message (other fields appended as ` k=v`).
    pub(crate) type Line = (Level, String);

    /// Collects events; install it with `tracing::subscriber::with_default`.
    #[derive(Debug, Default, Clone)]
    pub(crate) struct Capture {
        lines: Arc<Mutex<Vec<Line>>>,
        next_span: Arc<AtomicU64>,
    }

    impl Capture {
        /// Everything captured so far.
        pub(crate) fn lines(&self) -> Vec<Line> {
            self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
        }
    }

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                let _ = write!(self.0, "{value:?}");
            } else {
                let _ = write!(self.0, " {}={value:?}", field.name());
            }
        }
    }

    impl Subscriber for Capture {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &Attributes<'_>) -> Id {
            Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut m = Message(String::new());
            event.record(&mut m);
            self.lines
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((*event.metadata().level(), m.0));
        }
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// The `N` of the `... N similar messages suppressed` lines in `lines`.
    pub(crate) fn suppressed_counts(lines: &[Line]) -> Vec<u64> {
        lines
            .iter()
            .filter_map(|(_, m)| {
                let (head, _) = m.split_once(" similar messages suppressed")?;
                head.rsplit(' ').next()?.parse().ok()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::capture::{suppressed_counts, Capture};
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_burst_then_one_line_per_interval() {
        let l = RateLimiter::new();
        let t0 = 1_000 * S;
        for i in 0..BURST {
            assert_eq!(l.check_at(t0), Some(0), "line {i} of the burst");
        }
        for _ in 0..5 {
            assert_eq!(l.check_at(t0), None);
        }
        // Just under one interval later: still nothing.
        assert_eq!(l.check_at(t0 + INTERVAL_NS - 1), None);
        // One interval: one line, reporting the six dropped ones.
        assert_eq!(l.check_at(t0 + INTERVAL_NS), Some(6));
        assert_eq!(l.check_at(t0 + INTERVAL_NS), None);
        // Another interval: one more.
        assert_eq!(l.check_at(t0 + 2 * INTERVAL_NS), Some(1));
        assert_eq!(l.check_at(t0 + 2 * INTERVAL_NS + 1), None);
    }

    #[test]
    fn the_budget_refills_to_the_burst_and_no_further() {
        let l = RateLimiter::new();
        let t0 = 5 * S;
        for _ in 0..BURST {
            assert!(l.check_at(t0).is_some());
        }
        assert!(l.check_at(t0).is_none());
        // Three intervals of quiet: three lines.
        let t1 = t0 + 3 * INTERVAL_NS;
        assert_eq!(l.check_at(t1), Some(1));
        assert_eq!(l.check_at(t1), Some(0));
        assert_eq!(l.check_at(t1), Some(0));
        assert_eq!(l.check_at(t1), None);
        // A long quiet: the full burst again, never more.
        let t2 = t1 + 1000 * INTERVAL_NS;
        let passed = (0..100).filter(|_| l.check_at(t2).is_some()).count();
        assert_eq!(passed as u64, BURST);
    }

    #[test]
    fn the_first_check_at_time_zero_passes() {
        let l = RateLimiter::default();
        assert_eq!(l.check_at(0), Some(0));
    }

    #[test]
    fn concurrent_callers_share_one_budget_and_lose_no_count() {
        let l = std::sync::Arc::new(RateLimiter::new());
        let passed = std::sync::Arc::new(AtomicU64::new(0));
        let reported = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (l, passed, reported) = (l.clone(), passed.clone(), reported.clone());
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        if let Some(n) = l.check_at(7 * S) {
                            passed.fetch_add(1, Ordering::Relaxed);
                            reported.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(passed.load(Ordering::Relaxed), BURST);
        // The dropped lines are reported by the next line that goes out.
        assert_eq!(l.check_at(7 * S + INTERVAL_NS), Some(4000 - BURST));
    }

    #[test]
    fn the_macro_limits_its_call_site_and_says_how_many_it_dropped() {
        let capture = Capture::default();
        let site = |what: &str| crate::warn_limited!("bad thing {what}");
        tracing::subscriber::with_default(capture.clone(), || {
            for i in 0..1000 {
                site(&i.to_string());
            }
            test_clock::advance(REFILL_INTERVAL);
            site("again");
            // Another call site has its own budget.
            crate::error_limited!("other site");
        });
        let lines = capture.lines();
        let bad: Vec<_> = lines
            .iter()
            .filter(|(_, m)| m.starts_with("bad thing"))
            .collect();
        assert_eq!(bad.len() as u64, BURST + 1, "{lines:#?}");
        assert_eq!(bad[0].1, "bad thing 0");
        assert_eq!(bad.last().map(|b| b.1.as_str()), Some("bad thing again"));
        assert!(bad.iter().all(|(l, _)| *l == tracing::Level::WARN));
        assert_eq!(suppressed_counts(&lines), vec![1000 - BURST]);
        let count_line = lines
            .iter()
            .find(|(_, m)| m.contains("similar messages suppressed"))
            .unwrap();
        assert_eq!(count_line.0, tracing::Level::WARN);
        assert!(
            count_line.1.starts_with(concat!(file!(), ":")),
            "{count_line:?}"
        );
        // The count line comes right before the line that ended the suppression.
        let pos = lines.iter().position(|l| l == count_line).unwrap();
        assert_eq!(lines[pos + 1].1, "bad thing again");
        assert!(lines
            .iter()
            .any(|(l, m)| *l == tracing::Level::ERROR && m == "other site"));
    }

    #[test]
    fn a_disabled_level_consumes_no_budget() {
        struct WarnOnly(Capture);
        impl tracing::Subscriber for WarnOnly {
            fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
                *m.level() <= tracing::Level::WARN
            }
            fn new_span(&self, a: &tracing::span::Attributes<'_>) -> tracing::span::Id {
                self.0.new_span(a)
            }
            fn record(&self, i: &tracing::span::Id, r: &tracing::span::Record<'_>) {
                self.0.record(i, r)
            }
            fn record_follows_from(&self, a: &tracing::span::Id, b: &tracing::span::Id) {
                self.0.record_follows_from(a, b)
            }
            fn event(&self, e: &tracing::Event<'_>) {
                self.0.event(e)
            }
            fn enter(&self, i: &tracing::span::Id) {
                self.0.enter(i)
            }
            fn exit(&self, i: &tracing::span::Id) {
                self.0.exit(i)
            }
        }
        let capture = Capture::default();
        tracing::subscriber::with_default(WarnOnly(capture.clone()), || {
            for _ in 0..100 {
                crate::debug_limited!("chatty");
            }
        });
        assert!(capture.lines().is_empty());
    }
}

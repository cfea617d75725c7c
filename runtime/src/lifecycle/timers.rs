//! Timers: a sandbox's timeout, and the timer thread that enforces timeouts, max lifetimes,
//! the paused retention and the record retention.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::now_ms;
use crate::types::*;
use crate::{lock, Runtime, RuntimeError, Slot};

impl Runtime {
    /// Sets a sandbox's timeout to `secs` from now (and what expiry does, when given).
    pub fn set_timeout(
        &self,
        id: &str,
        secs: u64,
        on_timeout: Option<OnTimeout>,
    ) -> Result<SandboxInfo, RuntimeError> {
        let max = self.inner.cfg.max_lifetime.as_secs();
        if secs == 0 || secs > max {
            return Err(RuntimeError::Invalid(format!(
                "timeout must be 1 to {max} seconds"
            )));
        }
        let slot = self.slot(id)?;
        let mut st = lock(&slot.st);
        st.row.timeout_ms = secs as i64 * 1000;
        st.row.ends_ms = Some(now_ms() + st.row.timeout_ms);
        if let Some(o) = on_timeout {
            st.row.on_timeout = o;
        }
        self.store().update_sandbox(&st.row)?;
        let info = st.row.info();
        drop(st);
        self.record(
            now_ms(),
            Some(id),
            "set_timeout",
            &serde_json::json!({ "timeout_secs": secs }),
            0.0,
            &Ok::<(), RuntimeError>(()),
            (0, 0),
        );
        self.wake_timer();
        Ok(info)
    }

    /// Starts the timer thread: timeouts, max lifetimes, paused retention, record retention.
    pub(crate) fn start_timer(&self) -> Result<(), RuntimeError> {
        let weak = Arc::downgrade(&self.inner);
        let timer = self.inner.timer.clone();
        std::thread::Builder::new()
            .name("ember-timer".into())
            .spawn(move || {
                let mut last_purge = Instant::now() - Duration::from_secs(3600);
                loop {
                    // The runtime is held only for the pass, never while waiting: when its
                    // last user drops it, it goes (and kills its sandboxes if so configured)
                    // at once, not at the next tick — nor never, if the process exits first.
                    let next = {
                        let Some(inner) = weak.upgrade() else { return };
                        let rt = Runtime { inner };
                        let next = rt.tick();
                        if last_purge.elapsed() > Duration::from_secs(600) {
                            last_purge = Instant::now();
                            rt.purge_expired_records();
                        }
                        next
                    };
                    let (m, cv) = &*timer;
                    let mut woken = lock(m);
                    if !*woken {
                        woken = cv
                            .wait_timeout(woken, next.min(Duration::from_secs(1)))
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    *woken = false;
                }
            })
            .map_err(|e| RuntimeError::Internal(format!("cannot start the timer: {e}")))?;
        Ok(())
    }

    /// One pass of the timer: starts the due actions on their own threads; returns how long
    /// until the next deadline.
    fn tick(&self) -> Duration {
        let now = now_ms();
        let mut next = i64::MAX;
        let slots: Vec<Arc<Slot>> = lock(&self.inner.slots).values().cloned().collect();
        let retention = self.inner.cfg.paused_retention.as_millis() as i64;
        for slot in slots {
            let mut st = lock(&slot.st);
            if st.expiring {
                continue;
            }
            let action = match st.row.state {
                State::Running => {
                    let lifetime = st.row.max_until_ms.unwrap_or(i64::MAX);
                    let ends = st.row.ends_ms.unwrap_or(i64::MAX);
                    if lifetime <= now {
                        Some((OnTimeout::Kill, "max lifetime reached"))
                    } else if ends <= now {
                        Some((st.row.on_timeout, "timeout"))
                    } else {
                        next = next.min(ends.min(lifetime));
                        None
                    }
                }
                State::Paused => {
                    let paused_at = st.paused_ms.unwrap_or(now);
                    let expiry = paused_at + retention;
                    let lifetime = st.row.max_until_ms.unwrap_or(i64::MAX);
                    if expiry <= now {
                        Some((OnTimeout::Kill, "paused retention ended"))
                    } else if lifetime <= now {
                        Some((OnTimeout::Kill, "max lifetime reached"))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            if let Some((what, why)) = action {
                st.expiring = true;
                drop(st);
                let rt = self.clone();
                let slot = slot.clone();
                let _ = std::thread::Builder::new()
                    .name("ember-expire".into())
                    .spawn(move || {
                        let at = now_ms();
                        let t0 = Instant::now();
                        let r = match what {
                            OnTimeout::Kill => rt.stop(&slot.id, why).map(drop),
                            OnTimeout::Pause => rt.pause_inner(&slot.id, why).map(drop),
                        };
                        rt.record(
                            at,
                            Some(&slot.id),
                            match what {
                                OnTimeout::Kill => "timeout_kill",
                                OnTimeout::Pause => "timeout_pause",
                            },
                            &serde_json::json!({ "reason": why }),
                            t0.elapsed().as_secs_f64() * 1e3,
                            &r,
                            (0, 0),
                        );
                        if let Err(e) = r {
                            tracing::error!("sandbox {}: {why}: {e}", slot.id);
                        }
                        lock(&slot.st).expiring = false;
                    });
            }
        }
        if next == i64::MAX {
            Duration::from_secs(1)
        } else {
            Duration::from_millis((next - now).clamp(10, 1000) as u64)
        }
    }

    /// Deletes records and artifacts of sandboxes that ended longer ago than the record
    /// retention.
    fn purge_expired_records(&self) {
        let before = now_ms() - self.inner.cfg.record_retention.as_millis() as i64;
        let ids = match self.store().ended_before(before) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::error!("cannot list expired records: {e}");
                return;
            }
        };
        for id in ids {
            let _ = std::fs::remove_dir_all(self.inner.cfg.artifacts_dir(&id));
            if let Err(e) = self.store().purge_sandbox(&id) {
                tracing::error!("cannot purge sandbox {id}: {e}");
            }
        }
    }

    /// Wakes the timer thread for a new deadline (a create, a resume, a new timeout).
    pub(super) fn wake_timer(&self) {
        let (m, cv) = &*self.inner.timer;
        *lock(m) = true;
        cv.notify_all();
    }
}

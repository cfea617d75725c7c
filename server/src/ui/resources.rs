//! The sandbox page's "resources over time": a bounded ring of host-side usage samples per
//! sandbox ([`ember_runtime::Usage`]: the VMM's CPU over a short sample, its cgroup memory,
//! its copy-on-write disk layer), kept in the server's memory. Samples are taken only while
//! someone views the sandbox (each poll of `GET /ui/api/sandboxes/{id}/usage` takes at most
//! one every [`MIN_INTERVAL`], however many pages poll), so an unviewed sandbox costs nothing.
//! At most [`MAX_SAMPLES`] per sandbox and [`MAX_SANDBOXES`] sandboxes are kept (the one
//! sampled longest ago is forgotten first); a server restart forgets them all.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ember_runtime::Usage;

/// Samples kept per sandbox (at one per poll of 1.5 s: the last 3 minutes).
pub const MAX_SAMPLES: usize = 120;
/// Sandboxes with samples kept at once.
pub const MAX_SANDBOXES: usize = 64;
/// Shortest time between two samples of one sandbox.
pub const MIN_INTERVAL: Duration = Duration::from_millis(1000);

#[derive(Debug)]
struct Ring {
    /// When a sample was last started (taken or not).
    claimed: Instant,
    samples: VecDeque<Usage>,
}

/// Every sandbox's ring.
#[derive(Debug, Default)]
pub struct Rings {
    rings: Mutex<HashMap<String, Ring>>,
}

impl Rings {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ring>> {
        // A panic while holding it leaves only samples behind: still usable.
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the caller should take a sample of `id` now (true at most once per
    /// [`MIN_INTERVAL`]); a true answer is the claim.
    pub fn claim(&self, id: &str, now: Instant) -> bool {
        let mut rings = self.lock();
        if let Some(r) = rings.get_mut(id) {
            if now.saturating_duration_since(r.claimed) < MIN_INTERVAL {
                return false;
            }
            r.claimed = now;
            return true;
        }
        if rings.len() >= MAX_SANDBOXES {
            let oldest = rings
                .iter()
                .min_by_key(|(_, r)| r.claimed)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                rings.remove(&k);
            }
        }
        rings.insert(
            id.to_string(),
            Ring {
                claimed: now,
                samples: VecDeque::new(),
            },
        );
        true
    }

    /// Adds a sample of `id` (the oldest goes past [`MAX_SAMPLES`]).
    pub fn push(&self, id: &str, u: Usage) {
        if let Some(r) = self.lock().get_mut(id) {
            if r.samples.len() >= MAX_SAMPLES {
                r.samples.pop_front();
            }
            r.samples.push_back(u);
        }
    }

    /// `id`'s samples, oldest first.
    pub fn samples(&self, id: &str) -> Vec<Usage> {
        self.lock()
            .get(id)
            .map(|r| r.samples.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Usage {
        Usage {
            at_ms: ms,
            ..Default::default()
        }
    }

    #[test]
    fn one_claim_per_interval_and_bounded_rings() {
        let r = Rings::default();
        let t0 = Instant::now();
        assert!(r.claim("a", t0));
        assert!(!r.claim("a", t0 + Duration::from_millis(10)));
        assert!(r.claim("a", t0 + MIN_INTERVAL));
        for i in 0..(MAX_SAMPLES as i64 + 5) {
            r.push("a", at(i));
        }
        let s = r.samples("a");
        assert_eq!(s.len(), MAX_SAMPLES);
        assert_eq!(s[0].at_ms, 5);
        // Unclaimed: nothing kept.
        r.push("never", at(1));
        assert!(r.samples("never").is_empty());
        // Past MAX_SANDBOXES: the one claimed longest ago goes.
        for i in 0..MAX_SANDBOXES {
            assert!(r.claim(
                &format!("s{i}"),
                t0 + MIN_INTERVAL * 2 + Duration::from_millis(i as u64)
            ));
        }
        assert_eq!(r.lock().len(), MAX_SANDBOXES);
        assert!(r.samples("a").is_empty(), "the oldest ring is forgotten");
    }
}

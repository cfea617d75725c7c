//! Warm pools: members (for the runtime, jailed VMMs waiting for their restore request, see
//! `runtime/pooled.rs`) started ahead of demand, one pool per template snapshot, refilled in
//! the background by filler threads.
//!
//! - **Claims** take a member out of its pool under the pool's lock: a member is handed out at
//!   most once. A member found dead at claim time (or by the background check) is discarded and
//!   replaced.
//! - **Sizing**: each pool aims at `max(size, peak demand)`, at most `max`, where the peak
//!   demand is the most creates (claims, served or not) within any `lead` time over the last
//!   [`RATE_WINDOW`] (or `lead`, if longer): a steady rate keeps rate × lead VMMs ready, a
//!   burst keeps the pool at its size for the window.
//! - **Invalidation**: a pool whose snapshot directory is gone (its template was rebuilt or
//!   removed) is drained by the background thread; [`Pool::register`] with a new directory for
//!   a template drains the old one at once.
//! - **Shutdown**: [`Pool::drain`] stops the threads, waits for fills under way and discards
//!   every member.
//!
//! The pool knows nothing of VMs: what a member is, how it is started, checked and discarded
//! comes from a [`Filler`].

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How far back claims count for the create rate.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Starts, checks and discards members.
pub trait Filler: Send + Sync + 'static {
    /// A member.
    type Member: Send + 'static;
    /// Starts one member for the snapshot in `dir` (template `template`).
    fn fill(&self, template: &str, dir: &Path) -> Result<Self::Member, String>;
    /// Whether `m` is still usable (its process alive).
    fn alive(&self, m: &Self::Member) -> bool;
    /// Releases everything `m` holds.
    fn discard(&self, m: Self::Member);
}

/// Sizing and threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Members kept ready per template (0: the pool is off).
    pub size: usize,
    /// At most this many per template, whatever the rate.
    pub max: usize,
    /// Filler threads (fills run in parallel up to this).
    pub threads: usize,
    /// The rate-based target covers this much time of creates.
    pub lead: Duration,
    /// Prime members (see `runtime/pooled.rs`): a member's guest runs as soon as it is
    /// restored, its agent connection is made and synced and one silent cell runs in its
    /// default context, so that a create only syncs it. Off: members wait restored with their
    /// vCPUs held, and a create starts them.
    pub prime: bool,
}

impl Default for PoolSettings {
    fn default() -> Self {
        PoolSettings {
            size: 0,
            max: 32,
            threads: 2,
            lead: Duration::from_secs(1),
            prime: true,
        }
    }
}

/// Counters of one template's pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// The template.
    pub template: String,
    /// Its snapshot directory.
    pub dir: PathBuf,
    /// Members ready now.
    pub ready: usize,
    /// Fills under way.
    pub filling: usize,
    /// What the pool aims at now.
    pub target: usize,
    /// Claims served from the pool.
    pub hits: u64,
    /// Claims that found no ready member.
    pub misses: u64,
    /// Members found dead and replaced.
    pub replaced: u64,
    /// Fills that failed.
    pub fill_failures: u64,
}

struct Entry<M> {
    template: String,
    ready: VecDeque<M>,
    filling: usize,
    demand: VecDeque<Instant>,
    stats: PoolStats,
    /// After a failed fill, no new fill before this.
    backoff_until: Option<Instant>,
    failures_in_row: u32,
}

struct State<M> {
    pools: HashMap<PathBuf, Entry<M>>,
    stop: bool,
    filling: usize,
}

struct Shared<F: Filler> {
    filler: F,
    settings: PoolSettings,
    state: Mutex<State<F::Member>>,
    cv: Condvar,
}

/// A set of per-template pools and their filler threads.
pub struct Pool<F: Filler> {
    shared: Arc<Shared<F>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl<F: Filler> std::fmt::Debug for Pool<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<M> Entry<M> {
    fn target(&mut self, s: &PoolSettings, now: Instant) -> usize {
        let window = RATE_WINDOW.max(s.lead);
        while self
            .demand
            .front()
            .is_some_and(|t| now.duration_since(*t) > window)
        {
            self.demand.pop_front();
        }
        // The most claims within any `lead` of the window: a burst keeps the pool that
        // large for the window, a steady rate keeps it at rate × lead.
        let mut peak = 0;
        let mut start = 0;
        let times: Vec<Instant> = self.demand.iter().copied().collect();
        for (end, t) in times.iter().enumerate() {
            while t.duration_since(times[start]) > s.lead {
                start += 1;
            }
            peak = peak.max(end + 1 - start);
        }
        let t = s.size.max(peak).min(s.max.max(s.size));
        self.stats.target = t;
        t
    }
}

impl<F: Filler> Pool<F> {
    /// A pool (with no template yet) and its filler threads (none when `settings.size` is 0).
    pub fn new(filler: F, settings: PoolSettings) -> Pool<F> {
        let shared = Arc::new(Shared {
            filler,
            settings,
            state: Mutex::new(State {
                pools: HashMap::new(),
                stop: false,
                filling: 0,
            }),
            cv: Condvar::new(),
        });
        let mut threads = Vec::new();
        if settings.size > 0 {
            for i in 0..settings.threads.max(1) {
                let sh = shared.clone();
                match std::thread::Builder::new()
                    .name(format!("ember-pool-{i}"))
                    .spawn(move || worker(&sh))
                {
                    Ok(t) => threads.push(t),
                    Err(e) => tracing::error!("cannot start a pool filler thread: {e}"),
                }
            }
        }
        Pool {
            shared,
            threads: Mutex::new(threads),
        }
    }

    /// Whether the pool is on.
    pub fn enabled(&self) -> bool {
        self.shared.settings.size > 0
    }

    /// The settings.
    pub fn settings(&self) -> PoolSettings {
        self.shared.settings
    }

    /// Makes sure `template`'s snapshot `dir` has a pool (filled from now on); a pool of the
    /// same template for another directory (a rebuilt template) is drained.
    pub fn register(&self, template: &str, dir: &Path) {
        if !self.enabled() {
            return;
        }
        let mut old = Vec::new();
        {
            let mut st = lock(&self.shared.state);
            if st.stop {
                return;
            }
            let stale: Vec<PathBuf> = st
                .pools
                .iter()
                .filter(|(d, e)| e.template == template && d.as_path() != dir)
                .map(|(d, _)| d.clone())
                .collect();
            for d in stale {
                if let Some(e) = st.pools.remove(&d) {
                    old.extend(e.ready);
                }
            }
            st.pools.entry(dir.to_path_buf()).or_insert_with(|| Entry {
                template: template.to_string(),
                ready: VecDeque::new(),
                filling: 0,
                demand: VecDeque::new(),
                stats: PoolStats {
                    template: template.to_string(),
                    dir: dir.to_path_buf(),
                    ..Default::default()
                },
                backoff_until: None,
                failures_in_row: 0,
            });
        }
        self.shared.cv.notify_all();
        for m in old {
            self.shared.filler.discard(m);
        }
    }

    /// Takes a ready, live member of `dir`'s pool that `fits`, if there is one. Counts the
    /// demand either way (the pool grows with the create rate).
    pub fn claim(&self, dir: &Path, fits: impl Fn(&F::Member) -> bool) -> Option<F::Member> {
        if !self.enabled() {
            return None;
        }
        let mut dead = Vec::new();
        let got = {
            let mut st = lock(&self.shared.state);
            let e = st.pools.get_mut(dir)?;
            e.demand.push_back(Instant::now());
            let mut got = None;
            let mut skipped = VecDeque::new();
            while let Some(m) = e.ready.pop_front() {
                if !self.shared.filler.alive(&m) {
                    e.stats.replaced += 1;
                    dead.push(m);
                } else if fits(&m) {
                    got = Some(m);
                    break;
                } else {
                    skipped.push_back(m);
                }
            }
            skipped.extend(e.ready.drain(..));
            e.ready = skipped;
            if got.is_some() {
                e.stats.hits += 1;
            } else {
                e.stats.misses += 1;
            }
            got
        };
        self.shared.cv.notify_all();
        for m in dead {
            self.shared.filler.discard(m);
        }
        got
    }

    /// Releases a member taken with [`Pool::claim`] that will not be used.
    pub fn discard(&self, m: F::Member) {
        self.shared.filler.discard(m);
    }

    /// Counters of every template's pool.
    pub fn stats(&self) -> Vec<PoolStats> {
        let mut st = lock(&self.shared.state);
        let now = Instant::now();
        let settings = self.shared.settings;
        let mut v: Vec<PoolStats> = st
            .pools
            .values_mut()
            .map(|e| {
                e.target(&settings, now);
                &*e
            })
            .map(|e| PoolStats {
                ready: e.ready.len(),
                filling: e.filling,
                ..e.stats.clone()
            })
            .collect();
        v.sort_by(|a, b| a.template.cmp(&b.template));
        v
    }

    /// Waits until every registered pool has at least `n` ready members (or `timeout`).
    pub fn wait_ready(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            if !st.pools.is_empty() && st.pools.values().all(|e| e.ready.len() >= n) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Stops the filler threads, waits for fills under way and discards every member.
    pub fn drain(&self) {
        lock(&self.shared.state).stop = true;
        self.shared.cv.notify_all();
        let me = std::thread::current().id();
        for t in lock(&self.threads).drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        let members: Vec<F::Member> = {
            let mut st = lock(&self.shared.state);
            st.pools
                .drain()
                .flat_map(|(_, e)| e.ready.into_iter())
                .collect()
        };
        for m in members {
            self.shared.filler.discard(m);
        }
    }
}

impl<F: Filler> Drop for Pool<F> {
    fn drop(&mut self) {
        self.drain();
    }
}

/// What a filler thread does next.
enum Job {
    Fill(String, PathBuf),
    Discard(Vec<PathBuf>),
}

fn next_job<F: Filler>(sh: &Shared<F>, st: &mut State<F::Member>) -> Option<Job> {
    let now = Instant::now();
    // Pools whose snapshot went away (template rebuilt or removed).
    let gone: Vec<PathBuf> = st.pools.keys().filter(|d| !d.is_dir()).cloned().collect();
    if !gone.is_empty() {
        return Some(Job::Discard(gone));
    }
    let mut best: Option<(usize, PathBuf)> = None;
    for (dir, e) in st.pools.iter_mut() {
        if e.backoff_until.is_some_and(|t| t > now) {
            continue;
        }
        let target = e.target(&sh.settings, now);
        let have = e.ready.len() + e.filling;
        if have < target {
            let deficit = target - have;
            if best.as_ref().is_none_or(|(d, _)| deficit > *d) {
                best = Some((deficit, dir.clone()));
            }
        }
    }
    let (_, dir) = best?;
    let e = st.pools.get_mut(&dir)?;
    e.filling += 1;
    st.filling += 1;
    Some(Job::Fill(e.template.clone(), dir))
}

fn worker<F: Filler>(sh: &Shared<F>) {
    let mut last_check = Instant::now();
    loop {
        let job = {
            let mut st = lock(&sh.state);
            loop {
                if st.stop {
                    return;
                }
                if let Some(j) = next_job(sh, &mut st) {
                    break Some(j);
                }
                if last_check.elapsed() >= Duration::from_secs(1) {
                    break None;
                }
                st = sh
                    .cv
                    .wait_timeout(st, Duration::from_millis(250))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        };
        match job {
            Some(Job::Fill(template, dir)) => {
                let r = sh.filler.fill(&template, &dir);
                let mut st = lock(&sh.state);
                st.filling -= 1;
                let stop = st.stop;
                let leftover = match st.pools.get_mut(&dir) {
                    Some(e) => {
                        e.filling -= 1;
                        match r {
                            Ok(m) if !stop => {
                                e.ready.push_back(m);
                                e.failures_in_row = 0;
                                e.backoff_until = None;
                                None
                            }
                            Ok(m) => Some(m),
                            Err(err) => {
                                e.stats.fill_failures += 1;
                                e.failures_in_row += 1;
                                let wait =
                                    Duration::from_millis(100u64 << e.failures_in_row.min(8));
                                e.backoff_until = Some(Instant::now() + wait);
                                tracing::warn!(
                                    "pool {template}: cannot start a warm VMM (retrying in {} ms): \
                                     {err}",
                                    wait.as_millis()
                                );
                                None
                            }
                        }
                    }
                    // The pool was drained while this fill ran.
                    None => r.ok(),
                };
                drop(st);
                sh.cv.notify_all();
                if let Some(m) = leftover {
                    sh.filler.discard(m);
                }
            }
            Some(Job::Discard(dirs)) => {
                let members: Vec<F::Member> = {
                    let mut st = lock(&sh.state);
                    dirs.iter()
                        .filter_map(|d| st.pools.remove(d))
                        .flat_map(|e| e.ready.into_iter())
                        .collect()
                };
                for m in members {
                    sh.filler.discard(m);
                }
            }
            None => {
                // Replace members that died while waiting.
                last_check = Instant::now();
                let dead: Vec<F::Member> = {
                    let mut st = lock(&sh.state);
                    let mut dead = Vec::new();
                    for e in st.pools.values_mut() {
                        let (live, gone): (VecDeque<_>, Vec<_>) = std::mem::take(&mut e.ready)
                            .into_iter()
                            .fold((VecDeque::new(), Vec::new()), |(mut l, mut g), m| {
                                if sh.filler.alive(&m) {
                                    l.push_back(m);
                                } else {
                                    g.push(m);
                                }
                                (l, g)
                            });
                        e.stats.replaced += gone.len() as u64;
                        e.ready = live;
                        dead.extend(gone);
                    }
                    dead
                };
                if !dead.is_empty() {
                    sh.cv.notify_all();
                }
                for m in dead {
                    sh.filler.discard(m);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// Members are numbers; `alive` is a shared flag per member.
    #[derive(Default)]
    struct Counter {
        next: AtomicU64,
        discarded: Mutex<Vec<u64>>,
        dead: Mutex<Vec<u64>>,
        fail: AtomicBool,
    }

    impl Filler for Arc<Counter> {
        type Member = u64;
        fn fill(&self, _t: &str, _d: &Path) -> Result<u64, String> {
            if self.fail.load(Ordering::SeqCst) {
                return Err("no".into());
            }
            std::thread::sleep(Duration::from_millis(2));
            Ok(self.next.fetch_add(1, Ordering::SeqCst))
        }
        fn alive(&self, m: &u64) -> bool {
            !lock(&self.dead).contains(m)
        }
        fn discard(&self, m: u64) {
            lock(&self.discarded).push(m);
        }
    }

    fn settings(size: usize) -> PoolSettings {
        PoolSettings {
            size,
            max: 8,
            threads: 2,
            lead: Duration::from_secs(1),
            prime: false,
        }
    }

    #[test]
    fn fills_to_size_and_never_hands_a_member_out_twice() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counter::default());
        let pool = Arc::new(Pool::new(c.clone(), settings(3)));
        pool.register("t", dir.path());
        assert!(pool.wait_ready(3, Duration::from_secs(10)));
        let got = Arc::new(Mutex::new(Vec::new()));
        let ts: Vec<_> = (0..8)
            .map(|_| {
                let (pool, got, d) = (pool.clone(), got.clone(), dir.path().to_path_buf());
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        if let Some(m) = pool.claim(&d, |_| true) {
                            lock(&got).push(m);
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        let mut got = lock(&got).clone();
        let n = got.len();
        got.sort();
        got.dedup();
        assert_eq!(got.len(), n, "a member was handed out twice");
        assert!(n >= 3);
        let s = &pool.stats()[0];
        assert_eq!(s.hits as usize, n);
        assert_eq!(s.hits + s.misses, 160);
        // The demand raised the target above the configured size.
        assert!(s.target > 3, "{s:?}");
        pool.drain();
        assert!(pool.claim(dir.path(), |_| true).is_none());
    }

    #[test]
    fn a_dead_member_is_replaced_and_never_handed_out() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counter::default());
        let pool = Pool::new(c.clone(), settings(2));
        pool.register("t", dir.path());
        assert!(pool.wait_ready(2, Duration::from_secs(10)));
        lock(&c.dead).extend([0, 1]);
        // The background check replaces them.
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&c.discarded).len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(*lock(&c.discarded), vec![0, 1]);
        assert!(pool.wait_ready(2, Duration::from_secs(10)));
        let m = pool.claim(dir.path(), |_| true).unwrap();
        assert!(m >= 2);
        assert!(pool.stats()[0].replaced >= 2);
    }

    #[test]
    fn a_removed_snapshot_or_rebuilt_template_drains_its_pool() {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let c = Arc::new(Counter::default());
        let pool = Pool::new(c.clone(), settings(2));
        pool.register("t", &a);
        assert!(pool.wait_ready(2, Duration::from_secs(10)));
        // Rebuilt: a new directory for the same template.
        pool.register("t", &b);
        assert_eq!(lock(&c.discarded).len(), 2);
        assert!(pool.claim(&a, |_| true).is_none());
        assert!(pool.wait_ready(2, Duration::from_secs(10)));
        // Removed.
        std::fs::remove_dir_all(&b).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&c.discarded).len() < 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(lock(&c.discarded).len(), 4);
        assert!(pool.stats().is_empty());
    }

    #[test]
    fn failed_fills_back_off_and_drain_discards_everything() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counter::default());
        c.fail.store(true, Ordering::SeqCst);
        let pool = Pool::new(c.clone(), settings(2));
        pool.register("t", dir.path());
        std::thread::sleep(Duration::from_millis(300));
        let failures = pool.stats()[0].fill_failures;
        assert!((1..=6).contains(&failures), "{failures} failures in 300 ms");
        assert!(pool.claim(dir.path(), |_| true).is_none());
        c.fail.store(false, Ordering::SeqCst);
        assert!(pool.wait_ready(2, Duration::from_secs(30)));
        // A member that does not fit stays in the pool.
        assert!(pool.claim(dir.path(), |_| false).is_none());
        assert_eq!(pool.stats()[0].ready, 2);
        pool.drain();
        assert_eq!(lock(&c.discarded).len(), 2);
    }

    #[test]
    fn a_pool_of_size_zero_is_off() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(Counter::default());
        let pool = Pool::new(c.clone(), settings(0));
        pool.register("t", dir.path());
        assert!(!pool.enabled());
        assert!(pool.claim(dir.path(), |_| true).is_none());
        assert!(pool.stats().is_empty());
    }
}

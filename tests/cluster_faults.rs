//! The fleet under its faults (docs/cluster.md, "Failure model"), on the namespace cluster of
//! `tests/cluster/harness.rs`: three nodes (with `--vmm-watchdog 3`), two gateways, a real
//! PostgreSQL and S3 server. The test plays the engine and the faults:
//!
//! - a host dies (its node and VMMs SIGKILLed) during a create loop: it is declared lost
//!   within the threshold and no create fails (they go to the other nodes); its running
//!   sandbox and its paused one whose upload never happened answer "lost with its node";
//!   its paused, uploaded one continues on another node; back, it registers again;
//! - a node partitioned (its link down 20 s) fences itself (its VMs stopped), is declared
//!   lost, and on its return kills its VMs and registers with a new epoch; a 3 s blip of
//!   another node declares nothing;
//! - a node process frozen (SIGSTOP 15 s): its VMMs' watchdogs stop their vCPUs, it is
//!   declared lost, and thawed it kills its VMs;
//! - a node process killed and restarted: every VM re-adopted with its state, none lost, and a
//!   VM the directory never knew (made through the node's own API) killed at once;
//! - a gateway killed mid-load: the other gateway's clients see nothing; a create it left
//!   half done is cleaned within 30 s (the reservation swept, the VM killed by its node);
//! - all along, probes count in sandboxes (`n += 1`): no sandbox ever answers from two VMs
//!   (a count never repeats or goes back).
//!
//! Bounded: ~3–4 min here.

#[path = "cluster/harness.rs"]
mod harness;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_tests::bin;
use harness::*;

const NAME: &str = "the_fleet_survives_its_faults";
/// The nodes' VMM watchdog, seconds.
const WATCHDOG: &str = "3";

/// A sandbox made on node `host` through gateway 1, with `code` run in it.
fn on(c: &Cluster, host: &str, code: &str) -> String {
    let id = c
        .ember_ok(
            1,
            &["sandbox", "create", "--node-label", &format!("host={host}")],
        )
        .trim()
        .to_string();
    assert_eq!(c.node_of(&id), host, "{id} was not placed on {host}");
    c.ember_ok(1, &["code", &id, code]);
    id
}

/// Percentile `p` (0..=100) of `v` (sorted here).
fn pct(v: &mut [f64], p: usize) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) * p) / 100]
}

/// The probes: each sandbox is asked `n += 1; print(n)` through gateway 1 about twice a
/// second, on a thread of its own (a call to a frozen node may wait), and every answer is
/// kept: a count that repeats or goes back is a sandbox answering from two VMs.
struct Probes {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<BTreeMap<String, Vec<i64>>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Probes {
    fn new() -> Probes {
        Probes {
            stop: Arc::new(AtomicBool::new(false)),
            seen: Arc::new(Mutex::new(BTreeMap::new())),
            threads: Vec::new(),
        }
    }

    fn add(&mut self, c: &Cluster, id: &str) {
        c.ember_ok(1, &["code", id, "n = 0"]);
        let (url, token) = (c.gw_url(1), c.token());
        let (stop, seen, id) = (self.stop.clone(), self.seen.clone(), id.to_string());
        seen.lock().unwrap().insert(id.clone(), Vec::new());
        self.threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let out = Command::new("timeout")
                    .arg("20")
                    .arg(bin("ember"))
                    .args(["code", &id, "n += 1; print(n)"])
                    .env("EMBER_URL", &url)
                    .env("EMBER_TOKEN", &token)
                    .output();
                if let Ok(o) = out {
                    if let Ok(n) = String::from_utf8_lossy(&o.stdout).trim().parse::<i64>() {
                        if o.status.success() {
                            seen.lock().unwrap().get_mut(&id).unwrap().push(n);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }));
    }

    /// Stops the probes; asserts no count repeated or went back; answers the answers.
    fn finish(self) -> BTreeMap<String, Vec<i64>> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
        let seen = self.seen.lock().unwrap().clone();
        for (id, counts) in &seen {
            for w in counts.windows(2) {
                assert!(
                    w[1] > w[0],
                    "sandbox {id} answered from two VMs: its count went {} then {} ({counts:?})",
                    w[0],
                    w[1]
                );
            }
        }
        seen
    }
}

/// The watchdog's view of the VMM `pid` (its control socket, through its jail's root).
fn watchdog_of(pid: i32) -> Option<serde_json::Value> {
    let sock = format!("/proc/{pid}/root/work/api.sock");
    let reply =
        ember_vmm::api::call(std::path::Path::new(&sock), &ember_vmm::api::Request::Stats).ok()?;
    Some(reply["stats"]["watchdog"].clone())
}

/// S3 blocked (or not) from host `host`: its pauses are then not uploaded.
fn block_s3(c: &Cluster, host: &str, block: bool) {
    let ns = c.ns(host);
    if block {
        in_ns(&ns, &["nft", "add", "table", "inet", "ember_test_block"]);
        in_ns(
            &ns,
            &[
                "nft",
                "add chain inet ember_test_block out { type filter hook output priority 0 ; }",
            ],
        );
        in_ns(
            &ns,
            &[
                "nft",
                &format!("add rule inet ember_test_block out ip daddr {NET}.3 drop"),
            ],
        );
    } else {
        in_ns(&ns, &["nft", "delete", "table", "inet", "ember_test_block"]);
    }
}

#[test]
fn the_fleet_survives_its_faults() {
    let t0 = Instant::now();
    let Some(mut c) = start_fleet(NAME, &["--vmm-watchdog", WATCHDOG]) else {
        return;
    };
    eprintln!("cluster up in {:.1} s", t0.elapsed().as_secs_f64());
    let mut probes = Probes::new();
    let p1 = on(&c, "n1", "d = 4");
    probes.add(&c, &p1);

    // 1. A host dies during a create loop.
    let running = on(&c, "n3", "r = 1");
    let uploaded = on(&c, "n3", "p = 2");
    c.ember_ok(2, &["sandbox", "pause", &uploaded]);
    c.wait_sql(
        &format!("SELECT blob IS NOT NULL FROM sandboxes WHERE id = '{uploaded}'"),
        &format!("the pause of {uploaded} was not uploaded"),
    );
    // This one's pause stays on n3: the S3 server is out of its reach.
    let stranded = on(&c, "n3", "q = 3");
    block_s3(&c, "n3", true);
    c.ember_ok(2, &["sandbox", "pause", &stranded]);
    c.wait_sql(
        &format!("SELECT state = 'paused' AND blob IS NULL FROM sandboxes WHERE id = '{stranded}'"),
        &format!("{stranded} not recorded paused"),
    );
    let epoch3 = c.epoch("n3");
    let stop = AtomicBool::new(false);
    let (creates, detect) = std::thread::scope(|s| {
        let looper = s.spawn(|| {
            // Each create is killed at once: the load is the creates, not what they hold.
            let mut made = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                let (ok, out, err) = c.ember(1, &["sandbox", "create"]);
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let id = out.trim().to_string();
                if ok {
                    c.ember(1, &["sandbox", "kill", &id]);
                }
                made.push((ok, id, err, ms));
            }
            made
        });
        std::thread::sleep(Duration::from_secs(2));
        c.signal("n3", libc::SIGKILL);
        c.kill_vmms(3);
        let detect = c.wait_until(30, "n3 not declared lost", || {
            c.sql("SELECT status FROM nodes WHERE id = 'n3'") == "lost"
        });
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        (looper.join().unwrap(), detect)
    });
    c.kill_proc("n3");
    let failed: Vec<&String> = creates.iter().filter(|m| !m.0).map(|m| &m.2).collect();
    assert!(
        failed.is_empty(),
        "creates failed while n3 died: {failed:?}"
    );
    let mut ms: Vec<f64> = creates.iter().map(|m| m.3).collect();
    let retried = c
        .log_of("gw1")
        .lines()
        .filter(|l| l.contains("create: node n3 refused"))
        .count();
    eprintln!(
        "a dead host: declared lost after {:.1} s; {} creates during the window, none failed, \
         {retried} retried on another node; create p50 {:.0} ms, p95 {:.0} ms, max {:.0} ms",
        detect.as_secs_f64(),
        creates.len(),
        pct(&mut ms, 50),
        pct(&mut ms, 95),
        pct(&mut ms, 100)
    );
    for id in [&running, &stranded] {
        let t = Instant::now();
        let (ok, _, err) = c.ember(2, &["code", id, "print(1)"]);
        assert!(!ok && err.contains("lost with its node n3"), "{id}: {err}");
        eprintln!(
            "  {id} ({}): answered in {:.0} ms: {}",
            if *id == running {
                "running"
            } else {
                "paused, not uploaded"
            },
            t.elapsed().as_secs_f64() * 1e3,
            err.trim()
        );
    }
    let t = Instant::now();
    let out = c.ember_ok(2, &["code", &uploaded, "print(p)"]);
    assert_eq!(out.trim(), "2", "{uploaded} after its host died");
    let line = c.wait_log("gw2", &format!("sandbox {uploaded}: moved"), 5);
    eprintln!(
        "  {uploaded} (paused, uploaded): continued on {} in {:.0} ms to the first result ({})",
        c.node_of(&uploaded),
        t.elapsed().as_secs_f64() * 1e3,
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    probes.add(&c, &uploaded);
    block_s3(&c, "n3", false);
    c.start_node(3);
    c.wait_node(3);
    c.wait_until(10, "n3 did not come back", || {
        c.sql("SELECT status FROM nodes WHERE id = 'n3'") == "up"
    });
    assert!(c.epoch("n3") > epoch3, "n3 came back with the same epoch");

    // 2. A partition of n2 (20 s) and a blip of n1 (3 s).
    let cut = on(&c, "n2", "c = 7");
    probes.add(&c, &cut);
    let (epoch1, epoch2) = (c.epoch("n1"), c.epoch("n2"));
    c.link("n2", false);
    let t_cut = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    c.link("n1", false);
    std::thread::sleep(Duration::from_secs(3));
    c.link("n1", true);
    let fenced = c.wait_log("n2", "fenced:", 15);
    let fenced_after = t_cut.elapsed();
    c.wait_until(25, "n2 not declared lost", || {
        c.sql("SELECT status FROM nodes WHERE id = 'n2'") == "lost"
    });
    let lost_after = t_cut.elapsed();
    let (ok, _, err) = c.ember(1, &["code", &cut, "print(c)"]);
    assert!(!ok && err.contains("lost with its node n2"), "{cut}: {err}");
    assert_eq!(
        c.sql("SELECT status FROM nodes WHERE id = 'n1'"),
        "up",
        "a 3 s blip declared n1 lost"
    );
    assert_eq!(c.epoch("n1"), epoch1, "a 3 s blip changed n1's epoch");
    assert!(
        !c.log_of("n1").contains("fenced:"),
        "a 3 s blip fenced n1:\n{}",
        c.log_of("n1")
    );
    assert_eq!(c.ember_ok(1, &["code", &p1, "print(d)"]).trim(), "4");
    let vmms = c.vmm_pids(2);
    assert!(!vmms.is_empty(), "n2's VMs died with the partition");
    std::thread::sleep(Duration::from_secs(20).saturating_sub(t_cut.elapsed()));
    c.link("n2", true);
    let killed = c.wait_until(30, "n2 kept the VMs the fleet gave up", || {
        c.vmm_pids(2).is_empty()
    });
    c.wait_until(10, "n2 did not register again", || {
        c.sql("SELECT status FROM nodes WHERE id = 'n2'") == "up"
    });
    assert!(c.epoch("n2") > epoch2, "n2 came back with the same epoch");
    eprintln!(
        "a partition of n2 (20 s): fenced after {:.1} s ({}), declared lost after {:.1} s; \
         back, its {} VM(s) killed within {:.1} s, epoch {epoch2} -> {}; a 3 s blip of n1 \
         declared nothing",
        fenced_after.as_secs_f64(),
        fenced.split("ERROR").last().unwrap_or(&fenced).trim(),
        lost_after.as_secs_f64(),
        vmms.len(),
        killed.as_secs_f64(),
        c.epoch("n2")
    );

    // 3. The node process of n3 frozen for 15 s.
    let frozen = on(&c, "n3", "f = 5");
    probes.add(&c, &frozen);
    let epoch3 = c.epoch("n3");
    let vmms = c.vmm_pids(3);
    assert!(!vmms.is_empty());
    // The node arms each VMM's watchdog within a quarter of its timeout.
    c.wait_until(5, "n3 did not arm its VMMs' watchdogs", || {
        vmms.iter()
            .all(|p| watchdog_of(*p).is_some_and(|w| w["armed_ms"] == 3000))
    });
    c.signal("n3", libc::SIGSTOP);
    let t_stop = Instant::now();
    let t_wd = Instant::now();
    while !vmms
        .iter()
        .all(|p| watchdog_of(*p).is_some_and(|w| w["paused_by_watchdog"] == true))
    {
        let states: Vec<_> = vmms.iter().map(|p| (p, watchdog_of(*p))).collect();
        assert!(
            t_wd.elapsed() < Duration::from_secs(15),
            "the VMMs of the frozen n3 did not stop their vCPUs: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopped = t_stop.elapsed();
    c.wait_until(25, "the frozen n3 was not declared lost", || {
        c.sql("SELECT status FROM nodes WHERE id = 'n3'") == "lost"
    });
    let lost_after = t_stop.elapsed();
    let (ok, _, err) = c.ember(1, &["code", &frozen, "print(f)"]);
    assert!(
        !ok && err.contains("lost with its node n3"),
        "{frozen}: {err}"
    );
    std::thread::sleep(Duration::from_secs(15).saturating_sub(t_stop.elapsed()));
    c.signal("n3", libc::SIGCONT);
    let killed = c.wait_until(20, "the thawed n3 kept the VMs the fleet gave up", || {
        let now = c.vmm_pids(3);
        vmms.iter().all(|p| !now.contains(p))
    });
    c.wait_until(10, "n3 did not register again", || {
        c.sql("SELECT status FROM nodes WHERE id = 'n3'") == "up"
    });
    assert!(c.epoch("n3") > epoch3);
    eprintln!(
        "n3's process frozen (SIGSTOP 15 s): its {} VMM(s) stopped their vCPUs after {:.1} s \
         (watchdog {WATCHDOG} s); declared lost after {:.1} s; thawed, its VMs killed within \
         {:.1} s",
        vmms.len(),
        stopped.as_secs_f64(),
        lost_after.as_secs_f64(),
        killed.as_secs_f64()
    );

    // 4. n1's process killed (its VMMs live on) and started again, with a VM planted that
    // the directory never knew.
    let kept = on(&c, "n1", "k = 9");
    let n1_home = c.dir.path().join("n1");
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", c.ns("n1")))
        .arg("--")
        .arg(bin("ember"))
        .args(["sandbox", "create"])
        .env("EMBER_URL", format!("http://127.0.0.1:{API_PORT}"))
        .env(
            "EMBER_TOKEN",
            std::fs::read_to_string(n1_home.join("token"))
                .unwrap()
                .trim(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let orphan = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(
        c.sql(&format!(
            "SELECT count(*) FROM sandboxes WHERE id = '{orphan}'"
        )),
        "0"
    );
    let before = c.vmm_pids(1);
    c.kill_proc("n1");
    assert_eq!(c.vmm_pids(1), before, "n1's VMMs died with its process");
    let t_restart = Instant::now();
    c.start_node(1);
    c.wait_node(1);
    c.wait_log(
        "n1",
        &format!("sandbox {orphan}: the directory does not know it (found at start): killed"),
        15,
    );
    assert_eq!(c.ember_ok(1, &["code", &kept, "print(k)"]).trim(), "9");
    assert_eq!(c.ember_ok(1, &["code", &p1, "print(d)"]).trim(), "4");
    let on_n1: i64 = c
        .sql("SELECT count(*) FROM sandboxes WHERE node = 'n1' AND NOT ended AND state = 'running'")
        .parse()
        .unwrap();
    c.wait_until(
        10,
        "n1 runs another number of VMMs than the directory gives it",
        || c.vmm_pids(1).len() as i64 == on_n1,
    );
    eprintln!(
        "n1's process killed and started again: {} VM(s) re-adopted, none lost, the planted \
         one killed; calls answered {:.1} s after the restart",
        on_n1,
        t_restart.elapsed().as_secs_f64()
    );

    // 5. A gateway killed mid-load.
    let stop = AtomicBool::new(false);
    let (calls, creates) = std::thread::scope(|s| {
        let caller = s.spawn(|| {
            let mut calls = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                calls.push(c.ember(1, &["code", &kept, "print(k)"]));
            }
            calls
        });
        let creator = s.spawn(|| {
            // Those that answered (before it died); each killed at once.
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let (ok, out, _) = c.ember(2, &["sandbox", "create"]);
                if ok {
                    n += 1;
                    c.ember(1, &["sandbox", "kill", out.trim()]);
                } else {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            n
        });
        std::thread::sleep(Duration::from_millis(2300));
        c.signal("gw2", libc::SIGKILL);
        let killed_at = Instant::now();
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::SeqCst);
        (caller.join().unwrap(), (creator.join().unwrap(), killed_at))
    });
    let (calls, creates, killed_at) = (calls, creates.0, creates.1);
    c.kill_proc("gw2");
    let bad: Vec<String> = calls
        .iter()
        .filter(|(ok, out, _)| !ok || out.trim() != "9")
        .map(|(_, out, err)| format!("{out}{err}"))
        .collect();
    assert!(
        bad.is_empty(),
        "gateway 1's calls failed when gateway 2 died: {bad:?}"
    );
    c.wait_until(40, "a half-done create was not cleaned", || {
        c.sql("SELECT count(*) FROM sandboxes WHERE pending") == "0"
    });
    let cleaned = killed_at.elapsed();
    let orphans: usize = (1..=3)
        .map(|i| {
            c.log_of(&format!("n{i}"))
                .lines()
                .filter(|l| l.contains("the directory does not know it") && !l.contains(&orphan))
                .count()
        })
        .sum();
    eprintln!(
        "gateway 2 killed mid-load ({creates} creates through it before): gateway 1's {} calls \
         all answered; reservations cleaned {:.1} s after; {orphans} VM(s) of creates it left \
         half done killed by their nodes",
        calls.len(),
        cleaned.as_secs_f64()
    );
    c.start_gateway(2, false);

    let seen = probes.finish();
    eprintln!(
        "probes: {} answers from {} sandboxes, none from two VMs",
        seen.values().map(Vec::len).sum::<usize>(),
        seen.len()
    );
    eprintln!(
        "fault scenarios done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

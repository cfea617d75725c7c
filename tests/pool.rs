//! The warm pool end to end (real KVM, real jails): creates take jailed VMMs that were
//! started ahead (`ember-vmm --wait-restore`) and primed (guest running, connected, one silent
//! cell run), and those behave exactly like freshly spawned ones, with the clock and entropy
//! of their hand-out; an unprimed member is started by the create; concurrent creates never share a VMM; a pooled VMM that dies is replaced; the pool
//! grows with the create rate; a runtime that goes away leaves no process, jail, cgroup or
//! network namespace behind, and one that was killed has its leftovers reclaimed by the
//! next.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ember_agent::protocol::EndStatus;
use ember_runtime::CreateRequest;
use ember_runtime::{Runtime, RuntimeConfig};
use ember_tests::{runtime_config, template};

fn code(rt: &Runtime, id: &str, src: &str) -> (EndStatus, String, Option<String>) {
    ember_tests::run_code(rt, id, src)
}

fn home() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ember-pool-test-")
        .tempdir_in(std::env::temp_dir())
        .expect("temp home")
}

fn pooled_config(home: &Path, size: usize) -> RuntimeConfig {
    template("default");
    let mut cfg = runtime_config(home);
    cfg.pool.size = size;
    cfg.pool.max = size.max(8);
    cfg
}

fn open(cfg: RuntimeConfig) -> Runtime {
    Runtime::open(cfg).unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// How the create of `id` got its first agent connection ("attached": the template's kept one).
fn agent_link(rt: &Runtime, id: &str) -> String {
    let args = ember_tests::create_record_args(rt, id);
    args["vmm"]["agent"]["link"]
        .as_str()
        .unwrap_or_else(|| panic!("create record without vmm.agent.link: {args}"))
        .to_string()
}

/// How the create of `id` got its VMM: "pool-primed", "pool" (unprimed) or "fresh".
fn vmm_path(rt: &Runtime, id: &str) -> String {
    let args = ember_tests::create_record_args(rt, id);
    args["vmm"]["path"]
        .as_str()
        .unwrap_or_else(|| panic!("create record without vmm.path: {args}"))
        .to_string()
}

fn proc_status(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default()
}

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or("")
        .trim()
        .to_string()
}

/// Pids of the processes in the pool members' cgroups.
fn pool_pids(cfg: &RuntimeConfig) -> BTreeSet<u32> {
    let mut pids = BTreeSet::new();
    for jail in ember_runtime::jailed::cgroup_jail_ids(cfg) {
        if !jail.starts_with(ember_runtime::pooled::JAIL_PREFIX) {
            continue;
        }
        for dir in ember_runtime::jailed::cgroup_dirs(cfg, &jail) {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
    }
    pids
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What a sandbox looks like from inside: the answer of a computation, the template's
/// interpreter state, a file written and read back, and the guest's view of its disk.
fn observe(rt: &Runtime, id: &str) -> (String, String, Vec<u8>, String) {
    // The first cell sees IPython's history as the template left it: a primed member's
    // priming cell left no trace (no input stored, no `_`, no `Out` entry).
    let (st, history, _) = code(rt, id, "print(repr(_), repr(__), sorted(Out), len(In))");
    assert_eq!(st, EndStatus::Ok, "{history}");
    let (st, _, text) = code(rt, id, "6 * 7");
    assert_eq!(st, EndStatus::Ok);
    let (st, globals, _) = code(
        rt,
        id,
        "import sys\nprint(sorted(k for k in globals() if not k.startswith('_')))\n\
         print(sorted(m for m in sys.modules if not m.startswith('_'))[:50])",
    );
    assert_eq!(st, EndStatus::Ok, "{globals}");
    let body = format!("written in {}", "a sandbox").into_bytes();
    rt.write_file(id, "/tmp/pool-check.txt", &mut body.as_slice())
        .unwrap();
    let mut back = Vec::new();
    rt.read_file(id, "/tmp/pool-check.txt", &mut back).unwrap();
    let (st, disk, _) = code(
        rt,
        id,
        "import os\nprint(sorted(os.listdir('/etc'))[:40], os.path.exists('/root'))",
    );
    assert_eq!(st, EndStatus::Ok, "{disk}");
    (text.unwrap_or_default(), history + &globals, back, disk)
}

/// `n` bytes of the guest's `/dev/urandom` (hex) and the guest's wall clock minus the host's,
/// in ms, read in one cell.
fn entropy_and_clock(rt: &Runtime, id: &str) -> (String, f64) {
    let t0 = std::time::SystemTime::now();
    let (st, out, _) = code(
        rt,
        id,
        "import time\nt = time.time()\nprint(open('/dev/urandom', 'rb').read(16).hex(), t)",
    );
    let t1 = std::time::SystemTime::now();
    assert_eq!(st, EndStatus::Ok, "{out}");
    let mut parts = out.split_whitespace();
    let hex = parts.next().unwrap_or_default().to_string();
    let guest: f64 = parts.next().and_then(|t| t.parse().ok()).unwrap_or(0.0);
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    // The guest read its clock between t0 and t1: outside that window is its error.
    let (lo, hi) = (secs(t0), secs(t1));
    let off = if guest < lo {
        guest - lo
    } else if guest > hi {
        guest - hi
    } else {
        0.0
    };
    (hex, off * 1e3)
}

#[test]
fn a_pooled_vmm_restores_exactly_like_a_fresh_one_and_is_jailed() {
    let h = home();
    let rt = open(pooled_config(h.path(), 2));
    assert!(
        rt.pool_wait_ready(2, Duration::from_secs(120)),
        "the pool did not fill: {:?}",
        rt.pool_stats()
    );
    let stats = rt.pool_stats();
    assert_eq!(stats.len(), 1, "{stats:?}");
    assert_eq!(stats[0].template, "default");
    let pooled = rt.create(&CreateRequest::default()).unwrap().id;
    // Primed (the default): the member's guest ran, connected and synced, before the create.
    assert_eq!(vmm_path(&rt, &pooled), "pool-primed");
    // Fresh: a create whose limits differ from the pool's takes no pooled VMM.
    let fresh = rt
        .create(&CreateRequest {
            pids_max: Some(rt.config().pids_max - 1),
            ..Default::default()
        })
        .unwrap()
        .id;
    assert_eq!(vmm_path(&rt, &fresh), "fresh");
    // Both took over the template's kept agent connection (the primed one at its fill).
    assert_eq!(agent_link(&rt, &pooled), "primed");
    assert_eq!(agent_link(&rt, &fresh), "attached");
    // The create's sync gave the primed guest the clock and entropy of its hand-out: its
    // clock agrees with the host's, its random bytes are its own.
    let (rand_a, off_a) = entropy_and_clock(&rt, &pooled);
    let (rand_b, off_b) = entropy_and_clock(&rt, &fresh);
    println!("clock offsets from the host's: primed {off_a:.1} ms, fresh {off_b:.1} ms");
    assert!(
        off_a.abs() <= 50.0,
        "the primed guest's clock is {off_a:.1} ms off the host's"
    );
    assert!(
        off_b.abs() <= 50.0,
        "the fresh guest's clock is {off_b:.1} ms off the host's"
    );
    assert_eq!(rand_a.len(), 32, "{rand_a}");
    assert_ne!(
        rand_a, rand_b,
        "two clones read the same /dev/urandom bytes"
    );
    let a = observe(&rt, &pooled);
    let b = observe(&rt, &fresh);
    assert_eq!(a.0, "42");
    assert_eq!(a, b, "a pooled VMM's guest differs from a fresh one's");

    // Jailed like a fresh one: own uid, its jail's cgroup, seccomp filters on every thread.
    let info = rt.get(&pooled).unwrap();
    let row_pid = info.pid.expect("pid of the pooled sandbox");
    let status = proc_status(row_pid);
    let uid = status_field(&status, "Uid");
    assert!(
        uid.split_whitespace().all(|u| u != "0"),
        "pooled VMM runs as root: {uid}"
    );
    assert_eq!(status_field(&status, "Seccomp"), "2", "{status}");
    let filters: u32 = status_field(&status, "Seccomp_filters")
        .parse()
        .unwrap_or(0);
    assert!(
        filters >= 2,
        "main thread has {filters} filters (restore + main)"
    );
    let cgroup = std::fs::read_to_string(format!("/proc/{row_pid}/cgroup")).unwrap();
    assert!(
        cgroup.contains(ember_runtime::pooled::JAIL_PREFIX),
        "{cgroup}"
    );
    // The cgroup has the limits a fresh create gets.
    let pids_max = match cgroup.lines().find_map(|l| l.split_once(":pids:")) {
        // cgroup v1: the pids hierarchy.
        Some((_, path)) => std::fs::read_to_string(format!("/sys/fs/cgroup/pids{path}/pids.max")),
        // cgroup v2: the one hierarchy.
        None => {
            let path = cgroup
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/");
            std::fs::read_to_string(format!("/sys/fs/cgroup{path}/pids.max"))
        }
    }
    .unwrap_or_default();
    assert_eq!(pids_max.trim(), rt.config().pids_max.to_string());

    // Forks and pauses of a pooled sandbox continue its state like those of a fresh one.
    code(&rt, &pooled, "n = 41");
    let kids = rt
        .fork(
            &pooled,
            &ember_runtime::ForkRequest {
                count: 1,
                timeout_secs: None,
                metadata: None,
            },
        )
        .unwrap();
    assert_eq!(code(&rt, &kids[0].id, "n + 1").2.as_deref(), Some("42"));
    rt.kill(&kids[0].id).unwrap();
    // Pause and resume go through a fresh VMM from the pause snapshot, as for any sandbox.
    rt.pause(&pooled).unwrap();
    rt.resume(&pooled).unwrap();
    let (_, _, text) = code(&rt, &pooled, "n + 1");
    assert_eq!(text.as_deref(), Some("42"));
    rt.kill(&pooled).unwrap();
    rt.kill(&fresh).unwrap();
}

#[test]
fn an_unprimed_pool_member_is_started_by_the_create() {
    let h = home();
    let mut cfg = pooled_config(h.path(), 1);
    cfg.pool.prime = false;
    let rt = open(cfg);
    assert!(
        rt.pool_wait_ready(1, Duration::from_secs(120)),
        "the pool did not fill: {:?}",
        rt.pool_stats()
    );
    let id = rt.create(&CreateRequest::default()).unwrap().id;
    assert_eq!(vmm_path(&rt, &id), "pool");
    assert_eq!(agent_link(&rt, &id), "attached");
    let (history, _, _) = code(&rt, &id, "print(repr(_), len(In))");
    assert_eq!(history, EndStatus::Ok);
    assert_eq!(code(&rt, &id, "6 * 7").2.as_deref(), Some("42"));
    rt.kill(&id).unwrap();
}

#[test]
fn concurrent_creates_never_share_a_pooled_vmm_and_the_pool_grows_with_demand() {
    let h = home();
    let mut cfg = pooled_config(h.path(), 3);
    // Every create of this test falls within one lead time: the target is their number.
    cfg.pool.lead = Duration::from_secs(600);
    let rt = open(cfg);
    assert!(rt.pool_wait_ready(3, Duration::from_secs(120)));
    let before = pool_pids(rt.config());
    assert_eq!(before.len(), 3, "{before:?}");
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let rt = rt.clone();
            std::thread::spawn(move || rt.create(&CreateRequest::default()).map(|i| i.id))
        })
        .collect();
    let ids: Vec<String> = threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap_or_else(|e| panic!("create: {e}")))
        .collect();
    // Eight creates within the lead time: the target rose from 3 to 8 (the max).
    wait_for(
        "the target to follow the demand",
        Duration::from_secs(10),
        || rt.pool_stats()[0].target == 8,
    );
    let stats = rt.pool_stats()[0].clone();
    assert_eq!(stats.hits + stats.misses, 8, "{stats:?}");
    let mut pids = BTreeSet::new();
    let mut jails = BTreeSet::new();
    let mut pooled = 0;
    for id in &ids {
        let row = rt.get(id).unwrap();
        assert!(pids.insert(row.pid.unwrap()), "two sandboxes share a VMM");
        let vm_path = vmm_path(&rt, id);
        if vm_path.starts_with("pool") {
            pooled += 1;
        }
        let (_, out, _) = code(&rt, id, "print('hi from', 1 + 1)");
        assert_eq!(out.trim(), "hi from 2");
        jails
            .insert(std::fs::read_to_string(format!("/proc/{}/cgroup", row.pid.unwrap())).unwrap());
    }
    assert_eq!(jails.len(), ids.len(), "two sandboxes share a jail");
    assert!(pooled >= 1, "no create took a pooled VMM");
    // Each pooled VMM that was ready went to one create at most.
    let used: BTreeSet<u32> = pids.intersection(&before).copied().collect();
    assert!(used.len() <= before.len());
    assert_eq!(stats.hits as usize, pooled);
    for id in &ids {
        rt.kill(id).unwrap();
    }
}

#[test]
fn a_killed_pooled_vmm_is_replaced() {
    let h = home();
    let rt = open(pooled_config(h.path(), 2));
    assert!(rt.pool_wait_ready(2, Duration::from_secs(120)));
    let before = pool_pids(rt.config());
    let victim = *before.iter().next().expect("a pooled VMM");
    // SAFETY: kill(2) with a pid read from the pool's own cgroup and SIGKILL.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    wait_for("the dead VMM replaced", Duration::from_secs(120), || {
        let s = &rt.pool_stats()[0];
        s.replaced >= 1 && s.ready == 2
    });
    let after = pool_pids(rt.config());
    assert!(!after.contains(&victim));
    assert_eq!(after.len(), 2, "{after:?}");
    // Creates still work and use the pool.
    let id = rt.create(&CreateRequest::default()).unwrap().id;
    assert_eq!(vmm_path(&rt, &id), "pool-primed");
    assert_ne!(rt.get(&id).unwrap().pid, Some(victim));
    let (_, _, text) = code(&rt, &id, "6 * 7");
    assert_eq!(text.as_deref(), Some("42"));
    rt.kill(&id).unwrap();
}

fn netns_names() -> BTreeSet<String> {
    std::fs::read_dir("/run/netns")
        .map(|es| {
            es.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The namespaces of the runtime at `cfg.home` (`em-<tag>-…`, the tag from the home's
/// digest): tests running at the same time make namespaces of their own.
fn own_netns(cfg: &RuntimeConfig) -> BTreeSet<String> {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(cfg.home.as_os_str().as_encoded_bytes());
    let prefix = format!("em-{:02x}{:02x}-", digest[0], digest[1]);
    netns_names()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn leftovers(cfg: &RuntimeConfig, pids: &BTreeSet<u32>, ns: &BTreeSet<String>) -> Vec<String> {
    let mut left = Vec::new();
    for pid in pids {
        if Path::new(&format!("/proc/{pid}")).exists() && !proc_status(*pid).contains("State:\tZ") {
            left.push(format!("process {pid}"));
        }
    }
    if let Ok(es) = std::fs::read_dir(cfg.jails_dir()) {
        left.extend(es.flatten().map(|e| format!("jail {:?}", e.file_name())));
    }
    left.extend(
        ember_runtime::jailed::cgroup_jail_ids(cfg)
            .into_iter()
            .map(|j| format!("cgroup {j}")),
    );
    let now = netns_names();
    left.extend(ns.intersection(&now).map(|n| format!("netns {n}")));
    left
}

#[test]
fn dropping_the_runtime_leaves_no_pooled_vmm_jail_cgroup_or_namespace() {
    let h = home();
    let cfg = pooled_config(h.path(), 2);
    let rt = open(cfg.clone());
    assert!(rt.pool_wait_ready(2, Duration::from_secs(120)));
    let pids = pool_pids(&cfg);
    assert_eq!(pids.len(), 2);
    let ns = own_netns(&cfg);
    // The default template has a network device: each pooled VMM has its namespace.
    assert_eq!(ns.len(), 2, "{ns:?}");
    drop(rt);
    let left = leftovers(&cfg, &pids, &ns);
    assert!(left.is_empty(), "left behind: {left:?}");
    let pool_dir = ember_runtime::pooled::VmmFiller::pool_dir(&cfg);
    let files = std::fs::read_dir(&pool_dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(files, 0, "{} is not empty", pool_dir.display());
}

#[test]
fn a_killed_server_s_pool_is_reclaimed_by_the_next_runtime() {
    let h = home();
    let cfg = pooled_config(h.path(), 2);
    // A server with a pool, killed with SIGKILL (no drain).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = std::process::Command::new(ember_tests::bin("ember"))
        .args(["serve", "--pool", "2", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .env("EMBER_HOME", h.path())
        .env("EMBER_VMM", ember_tests::bin("ember-vmm"))
        .env("EMBER_JAILER", ember_tests::bin("ember-jailer"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the server's pool filled", Duration::from_secs(120), || {
        pool_pids(&cfg).len() == 2
    });
    let pids = pool_pids(&cfg);
    let ns = own_netns(&cfg);
    assert_eq!(ns.len(), 2, "{ns:?}");
    server.kill().unwrap();
    server.wait().unwrap();
    // The pooled VMMs outlive their server until the next runtime reclaims them.
    let mut cfg0 = cfg.clone();
    cfg0.pool.size = 0;
    let rt = open(cfg0.clone());
    drop(rt);
    let left = leftovers(&cfg0, &pids, &ns);
    assert!(left.is_empty(), "left behind: {left:?}");
    let pool_dir: PathBuf = ember_runtime::pooled::VmmFiller::pool_dir(&cfg0);
    assert!(!pool_dir.exists(), "{} is left", pool_dir.display());
}

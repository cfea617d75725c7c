//! ember on many hosts, for real (docs/cluster.md): hosts are network namespaces this test
//! makes, joined by a bridge in a namespace of their own; a real PostgreSQL (Debian's, started
//! by the test in a temporary directory) in one, three `ember node`s (each with its own
//! `$EMBER_HOME`, uid range and address pool) and two `ember gateway`s in others. The test
//! plays the engine: it starts, restarts and stops the processes. The test's own namespace
//! reaches the bridge through one veth pair; no namespace has a default route, so no packet
//! of the test can leave the machine.
//!
//! Scenarios (bounded: ~1–2 min here):
//! - every node registers and heartbeats (`ember cluster status`);
//! - creates through both gateways spread over the three nodes, and every sandbox is reachable
//!   through the other gateway with its interpreter state (a variable set through one gateway
//!   is read through the other);
//! - a file goes in through one gateway and out through the other, intact;
//! - a guest port exposed through one gateway serves HTTP through the other (the port
//!   proxy's connection tunnels through the sandbox's node), and over HTTPS by E2B's host
//!   route (`<port>-<id>.<domain>`) through gateway 1's TLS listener;
//! - a gateway restarted (stateless: routes are in the directory) serves the same sandboxes;
//! - the E2B Python SDK, unchanged: create, `run_code`, `files`, `commands` through gateway 1,
//!   then `Sandbox.connect` and the same sandbox's state through gateway 2;
//! - kill through one gateway, gone through the other;
//! - a quota of 5 live sandboxes holds across gateways: ten creates racing through both let
//!   exactly 5 in, and a kill frees a place at once.
//!
//! - the blob store is a real S3 server (moto's, in a namespace of its own): node n1 publishes
//!   the templates; n2 and n3 have caches of their own (empty: nothing travels between nodes
//!   but through S3) and pull a template on their first create of it;
//! - a sandbox paused on its node, uploaded, then that node stopped: the next call through the
//!   other gateway continues it on another node with its interpreter state; the node, back,
//!   drops its stale copy.
//!
//! - with a node down, a sandbox's artifacts (from S3) and audit log (from PostgreSQL) are
//!   read through a gateway;
//! - a fork's children spread over the nodes, each with its parent's state;
//! - a drain: every sandbox of the drained node continues on another, state intact.
//!
//! - a named snapshot, fleet-wide by name, uploaded; creates from it on several nodes;
//!
//! - the directory away for 10 s: calls to existing sandboxes go on, creates fail fast with
//!   503, nothing is declared lost, creates come back after it returns;
//!
//! The faults (a dead host, a partition, a frozen node, a node restarted, a gateway killed)
//! are `tests/cluster_faults.rs`'s.

#[path = "cluster/harness.rs"]
mod harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_tests::bin;
use harness::*;

const NAME: &str = "a_fleet_of_three_nodes_serves_through_either_gateway";

#[test]
fn a_fleet_of_three_nodes_serves_through_either_gateway() {
    let t0 = Instant::now();
    let Some(mut c) = start_fleet(NAME, &[]) else {
        return;
    };
    eprintln!("cluster up in {:.1} s", t0.elapsed().as_secs_f64());

    // Every node registered and heartbeats.
    let nodes = c.status();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    let holds =
        |n: &serde_json::Value, t: &str| n["templates"].as_array().unwrap().iter().any(|x| x == t);
    for n in &nodes {
        assert!(n["heartbeat_age_secs"].as_f64().unwrap() < 5.0, "{n}");
        // Only n1 has built templates; the others pull them.
        assert_eq!(holds(n, "default"), n["id"] == "n1", "{n}");
    }

    // Creates through both gateways spread over the nodes.
    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    for k in 0..30u8 {
        let gw = 1 + k % 2;
        let t = Instant::now();
        let id = c.ember_ok(gw, &["sandbox", "create"]).trim().to_string();
        create_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(id.len(), 16, "{id}");
        ids.push((id, gw));
    }
    create_ms.sort_by(f64::total_cmp);
    eprintln!(
        "create through a gateway (ember CLI, end to end): median {:.0} ms, max {:.0} ms",
        create_ms[create_ms.len() / 2],
        create_ms[create_ms.len() - 1]
    );
    let per_node: Vec<i64> = c
        .status()
        .iter()
        .map(|n| n["sandboxes"].as_i64().unwrap())
        .collect();
    assert_eq!(per_node.iter().sum::<i64>(), 30, "{per_node:?}");
    assert!(
        per_node.iter().all(|n| *n >= 1),
        "creates did not spread: {per_node:?}"
    );
    // n2 and n3 pulled the template from S3 into their own caches, under the same key.
    let key = std::fs::read_link(ember_runtime::paths::templates_dir().join("names/default"))
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    for i in 2..=3 {
        let line = c.wait_log(&format!("n{i}"), "template default: pulled", 5);
        eprintln!(
            "n{i}: {}",
            line.split("INFO").last().unwrap_or(&line).trim()
        );
        let cache = c.dir.path().join(format!("n{i}/cache"));
        let record = cache.join(format!("templates/{key}/template.json"));
        let info: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        let image = PathBuf::from(info["rootfs"].as_str().unwrap());
        assert!(
            image.starts_with(&cache),
            "n{i}'s template uses {}",
            image.display()
        );
        assert!(image.is_file());
    }
    // The next heartbeats say so.
    let t_hb = Instant::now();
    while !c.status().iter().all(|n| holds(n, "default")) {
        assert!(t_hb.elapsed() < Duration::from_secs(5), "{:?}", c.status());
        std::thread::sleep(Duration::from_millis(200));
    }

    // State set through one gateway is read through the other.
    for (k, (id, gw)) in ids.iter().enumerate() {
        c.ember_ok(*gw, &["code", id, &format!("x = {k} * 7")]);
        let other = 3 - gw;
        let out = c.ember_ok(other, &["code", id, "print(x)"]);
        assert_eq!(
            out.trim(),
            (k * 7).to_string(),
            "sandbox {id} through gateway {other}"
        );
    }

    // A file in through one gateway, out through the other.
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    let src = c.dir.path().join("in.bin");
    let dst = c.dir.path().join("out.bin");
    std::fs::write(&src, &data).unwrap();
    let id0 = ids[0].0.clone();
    c.ember_ok(
        1,
        &["cp", src.to_str().unwrap(), &format!("{id0}:/tmp/in.bin")],
    );
    c.ember_ok(
        2,
        &["cp", &format!("{id0}:/tmp/in.bin"), dst.to_str().unwrap()],
    );
    assert_eq!(
        std::fs::read(&dst).unwrap(),
        data,
        "the file changed on its way"
    );

    // A guest port through a gateway: the port proxy's connection is a tunnel through the
    // sandbox's node (an upgrade on its internal API).
    let web = ids[2].0.clone();
    c.ember_ok(
        1,
        &[
            "code",
            &web,
            "import subprocess, pathlib\n\
             pathlib.Path('/tmp/www').mkdir(exist_ok=True)\n\
             pathlib.Path('/tmp/www/hello.txt').write_text('hello through the fleet')\n\
             subprocess.Popen(['python3', '-m', 'http.server', '8000', '--directory', \
             '/tmp/www'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
        ],
    );
    c.ember_ok(2, &["sandbox", "expose", &web, "8000"]);
    let page = format!("{}/v1/sandboxes/{web}/ports/8000/hello.txt", c.gw_url(2));
    let t_web = Instant::now();
    let body = loop {
        let r = ureq::get(&page)
            .set("authorization", &format!("Bearer {}", c.token()))
            .timeout(Duration::from_secs(10))
            .call();
        match r {
            Ok(r) => break r.into_string().unwrap(),
            Err(e) => {
                // `python3 -m http.server` starting in the guest: seconds here, more on a
                // loaded host.
                assert!(
                    t_web.elapsed() < Duration::from_secs(120),
                    "{page}: {e}\n{}",
                    c.logs()
                );
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    };
    assert_eq!(body, "hello through the fleet");
    // The same page through gateway 1's HTTPS listener, by E2B's host route, with the
    // sandbox's own access token (as the E2B SDKs send it).
    let net: serde_json::Value = ureq::get(&format!("{}/v1/sandboxes/{web}/network", c.gw_url(1)))
        .set("authorization", &format!("Bearer {}", c.token()))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let own = net["access_token"].as_str().unwrap().to_string();
    let host = format!("8000-{web}.{DOMAIN}");
    let out = Command::new("curl")
        .args(["-sS", "--fail", "--max-time", "20", "--resolve"])
        .arg(format!("{host}:{TLS_PORT}:{NET}.21"))
        .arg("--cacert")
        .arg(c.dir.path().join("tls/ca.pem"))
        .arg("-H")
        .arg(format!("X-Access-Token: {own}"))
        .arg("-H")
        .arg(format!("E2B-Traffic-Access-Token: {own}"))
        .arg(format!("https://{host}:{TLS_PORT}/hello.txt"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello through the fleet",
        "https://{host}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = ureq::get(&page).call();
    assert!(
        matches!(r, Err(ureq::Error::Status(401, _))),
        "a private port without a token: {r:?}"
    );

    // Placement by label: only n3 is in zone b; a label no node has is refused by name.
    let zb = c
        .ember_ok(2, &["sandbox", "create", "--node-label", "zone=b"])
        .trim()
        .to_string();
    assert_eq!(
        c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{zb}'")),
        "n3"
    );
    c.ember_ok(1, &["sandbox", "kill", &zb]);
    let (ok, _, err) = c.ember(1, &["sandbox", "create", "--node-label", "zone=nowhere"]);
    assert!(!ok && err.contains("zone=nowhere"), "{err}");

    // A gateway restarted serves the same sandboxes (it keeps nothing).
    c.stop("gw1");
    c.start_gateway(1, false);
    let url = format!("{}/healthz", c.gw_url(1));
    c.wait_up("gw1", &url);
    let out = c.ember_ok(1, &["code", &id0, "print(x)"]);
    assert_eq!(out.trim(), "0");

    // The E2B Python SDK, unchanged, through gateway 1 then gateway 2.
    match e2b_python() {
        Ok(py) => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/e2b_two_gateways.py");
            let out = Command::new(py)
                .arg(&script)
                .arg(c.gw_url(1))
                .arg(c.gw_url(2))
                .env("E2B_API_KEY", c.token())
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && text.contains("ok"),
                "{text}\n{}",
                c.logs()
            );
            eprintln!("{}", text.trim());
        }
        Err(why) => ember_tests::skip(&format!("{NAME} (in part: the E2B SDK)"), &why),
    }

    // Paused on its node, uploaded, the node stopped: the next call through the other
    // gateway continues the sandbox on another node, state intact.
    let (mv, _) = ids[3].clone();
    let from = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{mv}'"));
    c.ember_ok(1, &["sandbox", "pause", &mv]);
    c.wait_sql(
        &format!("SELECT blob IS NOT NULL FROM sandboxes WHERE id = '{mv}'"),
        &format!("the pause of {mv} was not uploaded"),
    );
    let line = c.wait_log(&from, &format!("sandbox {mv}: pause uploaded"), 5);
    eprintln!(
        "{from}: {}",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    // Another sandbox of that node makes an artifact (collected, uploaded) and leaves an
    // audit trail: both stay readable through a gateway while the node is down.
    let (art, _) = ids
        .iter()
        .find(|(id, _)| {
            *id != mv && c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'")) == from
        })
        .expect("another sandbox on the node")
        .clone();
    c.ember_ok(
        1,
        &[
            "code",
            &art,
            "open('/workspace/outputs/fleet.txt', 'w').write('made before its node went away')",
        ],
    );
    c.ember_ok(1, &["artifacts", &art, "--collect"]);
    c.wait_sql(
        &format!("SELECT artifacts IS NOT NULL FROM sandboxes WHERE id = '{art}'"),
        &format!("the artifacts of {art} were not uploaded"),
    );
    // The next heartbeat ships the audit records.
    std::thread::sleep(Duration::from_millis(1500));
    c.stop(&from);
    // The node said it stopped (gateways read liveness at most a second old).
    let stopped = c
        .status()
        .iter()
        .any(|n| n["id"] == from.as_str() && n["status"] == "stopped");
    assert!(stopped, "{from} did not record its stop: {:?}", c.status());
    std::thread::sleep(Duration::from_millis(1100));
    let t_mv = Instant::now();
    let out = c.ember_ok(2, &["code", &mv, "print(x)"]);
    let moved_ms = t_mv.elapsed().as_secs_f64() * 1e3;
    assert_eq!(out.trim(), "21", "sandbox {mv} lost its state on the way");
    let to = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{mv}'"));
    assert_ne!(to, from, "{mv} did not move");
    let line = c.wait_log("gw2", &format!("sandbox {mv}: moved"), 5);
    eprintln!(
        "cross-node resume {from} -> {to}: {moved_ms:.0} ms to the first result ({})",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    let listed = c.ember_ok(2, &["artifacts", &art]);
    assert!(
        listed.contains("fleet.txt"),
        "artifacts of {art} with its node down: {listed}"
    );
    let got = c.dir.path().join("fleet.txt");
    c.ember_ok(
        2,
        &[
            "artifacts",
            &art,
            "--get",
            "fleet.txt",
            "-o",
            got.to_str().unwrap(),
        ],
    );
    assert_eq!(
        std::fs::read_to_string(&got).unwrap(),
        "made before its node went away"
    );
    let logs = c.ember_ok(1, &["logs", &art]);
    assert!(
        logs.contains("run_code") && logs.contains("collect_artifacts"),
        "audit of {art} with its node down: {logs}"
    );

    // Its history spans both nodes: the pause on the first, the move to the second.
    let hist = c.ember_ok(1, &["sandbox", "history", &mv]);
    assert!(
        hist.contains("paused by request") && hist.contains(&format!("continued from node {from}")),
        "history of {mv}: {hist}"
    );

    // The node comes back: its other sandboxes are re-adopted, its copy of the moved one
    // dropped.
    let n: u8 = from[1..].parse().unwrap();
    c.start_node(n);
    c.wait_up(
        &from,
        &format!("http://{NET}.{}:{INTERNAL_PORT}/internal/v1/health", 10 + n),
    );
    let stale = c.dir.path().join(format!("{from}/sandboxes/{mv}"));
    let t_back = Instant::now();
    while stale.exists() {
        assert!(
            t_back.elapsed() < Duration::from_secs(20),
            "{from} kept its copy of {mv}:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for (k, (id, _)) in ids.iter().enumerate() {
        let out = c.ember_ok(1, &["code", id, "print(x)"]);
        assert_eq!(
            out.trim(),
            (k * 7).to_string(),
            "sandbox {id} after {from} came back"
        );
    }

    // A drain by SIGTERM (what an engine sends to stop or upgrade a node): the node that
    // holds the moved sandbox pauses and uploads everything it runs, each sandbox continues
    // on another node, state intact, and the node exits. Clients calling all along see calls
    // that wait and follow, never an error. Restarted, the node is up again.
    let on_it: Vec<(usize, String)> = ids
        .iter()
        .enumerate()
        .filter(|(_, (id, _))| c.node_of(id) == to)
        .map(|(k, (id, _))| (k, id.clone()))
        .collect();
    assert!(!on_it.is_empty());
    let n: u8 = to[1..].parse().unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    let (exited, seen) = std::thread::scope(|s| {
        let client = s.spawn(|| {
            // Each sandbox in turn, until the node is gone and every one was called after.
            let mut calls: Vec<(String, bool, f64)> = Vec::new();
            let mut after = 0;
            while after < 2 {
                if done.load(std::sync::atomic::Ordering::SeqCst) {
                    after += 1;
                }
                for (k, id) in &on_it {
                    let t = Instant::now();
                    let (ok, out, err) = c.ember(1, &["code", id, "print(x)"]);
                    let right = ok && out.trim() == (k * 7).to_string();
                    calls.push((
                        if right {
                            id.clone()
                        } else {
                            format!("{id}: {err}{out}")
                        },
                        right,
                        t.elapsed().as_secs_f64() * 1e3,
                    ));
                }
            }
            calls
        });
        std::thread::sleep(Duration::from_millis(500));
        c.signal(&to, libc::SIGTERM);
        let t = Instant::now();
        while !c.exited(&to) && t.elapsed() < Duration::from_secs(120) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let exited = c.exited(&to).then(|| t.elapsed());
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (exited, client.join().unwrap())
    });
    let exited = exited.unwrap_or_else(|| panic!("{to} did not exit after SIGTERM:\n{}", c.logs()));
    c.kill_proc(&to);
    let failed: Vec<&String> = seen.iter().filter(|x| !x.1).map(|x| &x.0).collect();
    assert!(
        failed.is_empty(),
        "calls during the drain failed: {failed:?}"
    );
    let slowest = seen.iter().map(|x| x.2).fold(0.0, f64::max);
    eprintln!(
        "drain of {to} by SIGTERM ({} sandboxes): exited after {:.1} s; {} calls during it, \
         none failed, the slowest {slowest:.0} ms",
        on_it.len(),
        exited.as_secs_f64(),
        seen.len()
    );
    for (_, id) in &on_it {
        assert_ne!(c.node_of(id), to, "{id} stayed on the drained node");
    }
    c.start_node(n);
    c.wait_node(n);
    assert!(c
        .status()
        .iter()
        .any(|x| x["id"] == to.as_str() && x["status"] == "up"));

    // A fork: the children spread over the nodes (each moved the way a paused sandbox
    // moves), every one with its parent's state.
    let (parent, _) = ids[0].clone();
    let parent_node = c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{parent}'"));
    let t_fork = Instant::now();
    let out = c.ember_ok(1, &["sandbox", "fork", &parent, "--count", "3"]);
    let fork_ms = t_fork.elapsed().as_secs_f64() * 1e3;
    let children: Vec<String> = out.split_whitespace().map(str::to_string).collect();
    assert_eq!(children.len(), 3, "{out}");
    let mut child_nodes = std::collections::BTreeSet::new();
    for ch in &children {
        let out = c.ember_ok(2, &["code", ch, "print(x)"]);
        assert_eq!(out.trim(), "0", "fork child {ch}");
        child_nodes.insert(c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{ch}'")));
    }
    assert!(
        child_nodes.len() >= 2 && child_nodes.iter().any(|n| *n != parent_node),
        "the children of {parent} (on {parent_node}) did not spread: {child_nodes:?}"
    );
    eprintln!(
        "fork of a sandbox on {parent_node} into 3: {fork_ms:.0} ms, children on {child_nodes:?}"
    );
    for ch in &children {
        c.ember_ok(1, &["sandbox", "kill", ch]);
    }

    // A named snapshot: its name is the fleet's (a second of that name is refused), it is
    // uploaded, and creates from it land on other nodes too (the drained node, empty now, is
    // the least busy: it pulls the snapshot), each with the state it was taken with.
    let (src, _) = ids[5].clone();
    c.ember_ok(1, &["sandbox", "snapshot", &src, "--name", "fleet-snap"]);
    let (ok, _, err) = c.ember(
        2,
        &["sandbox", "snapshot", &ids[6].0, "--name", "fleet-snap"],
    );
    assert!(
        !ok && err.contains("exists"),
        "a second snapshot of that name: {err}"
    );
    c.wait_sql(
        "SELECT blob IS NOT NULL FROM snapshots WHERE name = 'fleet-snap'",
        "snapshot fleet-snap not uploaded",
    );
    let mut from_snap = Vec::new();
    let mut snap_nodes = std::collections::BTreeSet::new();
    for k in 0..4u8 {
        let id = c
            .ember_ok(
                1 + k % 2,
                &["sandbox", "create", "--snapshot", "fleet-snap"],
            )
            .trim()
            .to_string();
        let out = c.ember_ok(2 - k % 2, &["code", &id, "print(x)"]);
        assert_eq!(out.trim(), "35", "sandbox {id} from snapshot fleet-snap");
        snap_nodes.insert(c.sql(&format!("SELECT node FROM sandboxes WHERE id = '{id}'")));
        from_snap.push(id);
    }
    let origin = c.sql("SELECT node FROM snapshots WHERE name = 'fleet-snap'");
    assert!(
        snap_nodes.iter().any(|n| *n != origin),
        "creates from the snapshot (taken on {origin}) stayed there: {snap_nodes:?}"
    );
    let other = snap_nodes.iter().find(|n| **n != origin).unwrap().clone();
    let line = c.wait_log(&other, "snapshot fleet-snap: pulled", 5);
    eprintln!(
        "4 creates from snapshot fleet-snap (taken on {origin}) landed on {snap_nodes:?}; {other}: {}",
        line.split("INFO").last().unwrap_or(&line).trim()
    );
    for id in &from_snap {
        c.ember_ok(2, &["sandbox", "kill", id]);
    }

    // Killed through one gateway, gone through the other.
    let (id1, _) = ids[1].clone();
    c.ember_ok(2, &["sandbox", "kill", &id1]);
    let (ok, _, err) = c.ember(1, &["code", &id1, "print(1)"]);
    assert!(!ok, "a killed sandbox still ran code");
    assert!(err.contains(&id1), "{err}");

    // A quota holds across gateways: two gateways racing ten creates against a quota of 5
    // let exactly 5 in; a kill frees a place at once.
    for (id, _) in &ids[2..] {
        c.ember_ok(1, &["sandbox", "kill", id]);
    }
    c.ember_ok(1, &["sandbox", "kill", &id0]);
    run(Command::new(bin("ember")).args([
        "cluster",
        "quota",
        "--db",
        &c.db_url(),
        "--max-sandboxes",
        "5",
    ]));
    let racers: Vec<_> = (0..10u8)
        .map(|k| {
            let mut cmd = Command::new(bin("ember"));
            cmd.args(["sandbox", "create"])
                .env("EMBER_URL", c.gw_url(1 + k % 2))
                .env("EMBER_TOKEN", c.token())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for r in racers {
        let out = r.wait_with_output().unwrap();
        if out.status.success() {
            admitted.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
        } else {
            refused.push(String::from_utf8_lossy(&out.stderr).into_owned());
        }
    }
    assert_eq!(
        admitted.len(),
        5,
        "admitted {admitted:?}, refused {refused:?}\n{}",
        c.logs()
    );
    for why in &refused {
        assert!(why.contains("quota"), "{why}");
    }
    let (ok, _, err) = c.ember(2, &["sandbox", "create"]);
    assert!(!ok && err.contains("quota"), "a sixth create: {err}");
    c.ember_ok(2, &["sandbox", "kill", &admitted[0]]);
    let sixth = c.ember_ok(1, &["sandbox", "create"]);
    assert_eq!(sixth.trim().len(), 16, "{sixth}");

    // The directory goes away for 10 s: calls to existing sandboxes go on (the gateways'
    // route caches; the nodes need no database to serve them), a create fails fast with a
    // 503 naming the directory, and nothing is declared lost; creates work again soon after
    // its return.
    run(Command::new(bin("ember")).args([
        "cluster",
        "quota",
        "--db",
        &c.db_url(),
        "--max-sandboxes",
        "0",
    ]));
    let alive: Vec<String> = admitted[1..]
        .iter()
        .cloned()
        .chain([sixth.trim().to_string()])
        .collect();
    for id in &alive {
        for gw in 1..=2 {
            c.ember_ok(gw, &["code", id, "print(1)"]);
        }
    }
    c.pg_ctl("stop");
    let t_out = Instant::now();
    let (mut ok_calls, mut failed_calls) = (0u32, Vec::new());
    while t_out.elapsed() < Duration::from_secs(10) {
        for (k, id) in alive.iter().enumerate() {
            let gw = 1 + (k % 2) as u8;
            let (ok, out, err) = c.ember(gw, &["code", id, "print(6 * 7)"]);
            if ok && out.trim() == "42" {
                ok_calls += 1;
            } else {
                failed_calls.push(err);
            }
        }
    }
    let t = Instant::now();
    let (ok, _, err) = c.ember(1, &["sandbox", "create"]);
    let refused_ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        !ok && err.contains("HTTP 503") && err.contains("directory"),
        "a create with the directory away: {err}"
    );
    let total = ok_calls as usize + failed_calls.len();
    assert!(
        failed_calls.len() * 100 <= total,
        "with the directory away, {} of {total} calls failed: {:?}",
        failed_calls.len(),
        failed_calls.first()
    );
    c.pg_ctl("start");
    let t_back = Instant::now();
    let created = loop {
        let (ok, out, _) = c.ember(2, &["sandbox", "create"]);
        if ok {
            break out.trim().to_string();
        }
        assert!(
            t_back.elapsed() < Duration::from_secs(10),
            "creates did not come back:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let back_ms = t_back.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "the directory away for 10 s: {ok_calls} of {total} calls to existing sandboxes \
         succeeded; a create was refused in {refused_ms:.0} ms (503); creates back {back_ms:.0} \
         ms after its return"
    );
    // Past the sweep's grace (it waits until it has reached the directory for longer than a
    // node's silence may last): no node was declared lost for the outage.
    std::thread::sleep(Duration::from_secs(14));
    for n in c.status() {
        assert_eq!(n["status"], "up", "after the directory's outage: {n}");
    }
    c.ember_ok(1, &["sandbox", "kill", &created]);

    eprintln!(
        "cluster scenario done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

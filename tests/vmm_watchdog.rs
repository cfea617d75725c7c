//! The VMM watchdog (`{"op":"watchdog","timeout_ms":N}` on the control socket) with a real
//! guest: keep-alives keep the VM running; when they stop, the VMM pauses its own vCPUs (they
//! really stop: KVM's exit counter stands still); the next keep-alive resumes them; a VM paused
//! deliberately is not resumed by a keep-alive; disarmed, nothing expires.
//!
//! The guest runs a shell busy loop (`ember.run`), so its vCPU keeps exiting to KVM (timer
//! ticks) while it runs and KVM's `exits` counter moves.

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use ember_tests::{kernel, rootfs, skip, RunningVmm};
use ember_vmm::api::{call, Request};

const NAME: &str = "vmm_watchdog";
/// A boot to init costs seconds on kvm_pvm; twice this on a loaded host is still a pass.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const PERIOD_MS: u64 = 1000;

fn request(api: &Path, req: &Request) -> serde_json::Value {
    let reply = call(api, req).unwrap_or_else(|e| panic!("{req:?}: {e}"));
    assert_eq!(reply["ok"], true, "{req:?}: {reply}");
    reply
}

fn stats(api: &Path) -> serde_json::Value {
    request(api, &Request::Stats)["stats"].clone()
}

/// A keep-alive (or arming, or with 0 disarming): whether it resumed a VM the watchdog paused.
fn keep_alive(api: &Path, timeout_ms: u64) -> bool {
    let reply = request(api, &Request::Watchdog { timeout_ms });
    reply["paused_by_watchdog"]
        .as_bool()
        .unwrap_or_else(|| panic!("no paused_by_watchdog in {reply}"))
}

/// KVM's count of the guest's vCPU exits so far.
fn exits(stats: &serde_json::Value) -> u64 {
    stats["kvm"]["vcpu"]["exits"]
        .as_u64()
        .unwrap_or_else(|| panic!("no kvm.vcpu.exits counter in the stats: {stats}"))
}

/// Two reads of the exit counter 300 ms apart.
fn exits_over_300ms(api: &Path) -> (u64, u64) {
    let a = exits(&stats(api));
    std::thread::sleep(Duration::from_millis(300));
    (a, exits(&stats(api)))
}

#[test]
fn a_vm_whose_owner_stops_feeding_the_watchdog_pauses_until_the_next_keep_alive() {
    if !Path::new("/dev/kvm").exists() {
        skip(NAME, "no /dev/kvm");
        return;
    }
    let t_test = Instant::now();
    // Located (or built, the first time) before the clock for the boot starts.
    let (k, r) = (kernel(), rootfs());
    let t_boot = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let api = d.join("vm.api");
    let busy = base64::engine::general_purpose::STANDARD.encode("while :; do :; done");
    let mut args: Vec<OsString> = vec!["--kernel".into(), k.into(), "--disk".into()];
    args.push(format!("path={},mode=ro,id=rootfs", r.display()).into());
    args.push("--api-sock".into());
    args.push(api.clone().into());
    args.push("--cmdline-append".into());
    args.push(format!("ember.run={busy}").into());
    let mut vm = RunningVmm::start(d, "vm", &args);
    // Init is up (marker 1) and about to run the busy loop.
    vm.wait_marker(1, BOOT_TIMEOUT);
    let booted = t_boot.elapsed();

    // Disarmed by default.
    let s = stats(&api);
    assert_eq!(
        s["watchdog"],
        serde_json::json!({"armed_ms": null, "paused_by_watchdog": false, "expiries": 0}),
        "{s}"
    );
    // Out of bounds: refused, naming the bounds, and nothing armed.
    let reply = call(&api, &Request::Watchdog { timeout_ms: 5 }).unwrap();
    assert_eq!(reply["ok"], false, "{reply}");
    let err = reply["error"].as_str().unwrap_or_default();
    assert!(err.contains("100") && err.contains("3600000"), "{reply}");
    assert!(stats(&api)["watchdog"]["armed_ms"].is_null());

    // Armed at 1 s and fed every 250 ms for 2 s: the VM runs on.
    let t = Instant::now();
    assert!(!keep_alive(&api, PERIOD_MS));
    while t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(250));
        assert!(!keep_alive(&api, PERIOD_MS));
        let s = stats(&api);
        assert_eq!(s["paused"], false, "fed, yet paused: {s}");
        assert_eq!(s["watchdog"]["armed_ms"], PERIOD_MS, "{s}");
        assert_eq!(s["watchdog"]["expiries"], 0, "{s}");
    }
    let last_feed = Instant::now();

    // The owner stops feeding: within 1.5 s the VMM has paused its vCPUs.
    let s = loop {
        let s = stats(&api);
        if s["paused"] == true {
            break s;
        }
        assert!(
            last_feed.elapsed() < Duration::from_millis(1500),
            "not paused {:?} after the last keep-alive: {s}",
            last_feed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let paused_after = last_feed.elapsed();
    assert!(
        paused_after >= Duration::from_millis(PERIOD_MS - 50),
        "paused {paused_after:?} after the last keep-alive, before the deadline: {s}"
    );
    assert_eq!(s["watchdog"]["paused_by_watchdog"], true, "{s}");
    assert_eq!(s["watchdog"]["expiries"], 1, "{s}");
    // Really stopped: no vCPU exits while paused.
    let (a, b) = exits_over_300ms(&api);
    assert_eq!(a, b, "the vCPUs ran while paused by the watchdog");
    let expired: Vec<_> = vm
        .events()
        .into_iter()
        .filter(|e| e["event"] == "watchdog_expired")
        .collect();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0]["outcome"], "paused", "{expired:?}");
    assert_eq!(expired[0]["timeout_ms"], PERIOD_MS, "{expired:?}");

    // A keep-alive resumes it, and says so.
    assert!(keep_alive(&api, PERIOD_MS), "the keep-alive did not resume");
    let s = stats(&api);
    assert_eq!(s["paused"], false, "{s}");
    assert_eq!(s["watchdog"]["paused_by_watchdog"], false, "{s}");
    let (a, b) = exits_over_300ms(&api);
    assert!(
        b > a,
        "the vCPUs did not run again after the keep-alive ({a} → {b})"
    );
    let running_exits = b - a;
    assert!(!keep_alive(&api, PERIOD_MS));

    // Paused deliberately: a keep-alive does not resume it.
    request(&api, &Request::Pause);
    assert!(!keep_alive(&api, PERIOD_MS), "resumed a deliberate pause");
    let s = stats(&api);
    assert_eq!(s["paused"], true, "{s}");
    assert_eq!(s["watchdog"]["paused_by_watchdog"], false, "{s}");
    let (a, b) = exits_over_300ms(&api);
    assert_eq!(a, b, "the vCPUs ran while paused deliberately");

    // Disarmed (and resumed deliberately): nothing expires over 1.5 s, the VM runs on.
    assert!(!keep_alive(&api, 0));
    request(&api, &Request::Resume);
    let before = stats(&api);
    assert!(before["watchdog"]["armed_ms"].is_null(), "{before}");
    let expiries = before["watchdog"]["expiries"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let after = stats(&api);
    assert_eq!(after["paused"], false, "{after}");
    assert_eq!(after["watchdog"]["expiries"], expiries, "{after}");
    assert_eq!(after["watchdog"]["paused_by_watchdog"], false, "{after}");
    assert!(exits(&after) > exits(&before), "{before}\n{after}");
    let resumed = vm
        .events()
        .iter()
        .filter(|e| e["event"] == "watchdog_resumed")
        .count();
    assert_eq!(resumed, 1);

    request(&api, &Request::Shutdown);
    let status = vm.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    eprintln!(
        "{NAME}: boot to init {:.1} s, watchdog paused the VM {} ms after the last keep-alive, \
         {running_exits} vCPU exits in 300 ms running (0 paused), whole test {:.1} s",
        booted.as_secs_f64(),
        paused_after.as_millis(),
        t_test.elapsed().as_secs_f64()
    );
}

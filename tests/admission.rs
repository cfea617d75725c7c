//! The runtime's start gate (runtime/src/gate.rs) with real VMs: with
//! `max_starting = 1`, creates issued at once wait in line instead of starting together,
//! every one of them still succeeds and answers, and the create records say how long each
//! waited.

use std::sync::Arc;

use ember_runtime::CreateRequest;
use ember_runtime::Runtime;
use ember_tests::{runtime_config, template};

#[test]
fn creates_beyond_the_start_limit_wait_in_line_and_all_answer() {
    template("default");
    let home = tempfile::Builder::new()
        .prefix("ember-admission-test-")
        .tempdir_in(std::env::temp_dir())
        .expect("temp home");
    let mut cfg = runtime_config(home.path());
    cfg.max_starting = 1;
    let rt = Arc::new(Runtime::open(cfg).unwrap_or_else(|e| panic!("runtime: {e}")));
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (rt, barrier) = (rt.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                rt.create(&CreateRequest::default())
                    .unwrap_or_else(|e| panic!("create: {e}"))
                    .id
            })
        })
        .collect();
    let ids: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut queued = Vec::new();
    for id in &ids {
        let (_, _, text) = ember_tests::run_code(&rt, id, "6 * 7");
        assert_eq!(text.as_deref(), Some("42"), "{id}");
        let args = ember_tests::create_record_args(&rt, id);
        let ms = args["vmm"]["queued_ms"]
            .as_f64()
            .unwrap_or_else(|| panic!("create record without vmm.queued_ms: {args}"));
        queued.push(ms);
    }
    // Four starts of ~100 ms or more each, begun together, one at a time: the last in line
    // waited for at least two others.
    queued.sort_by(f64::total_cmp);
    assert!(queued[3] > 0.0 && queued[2] > 0.0, "queued ms: {queued:?}");
    for id in &ids {
        rt.kill(id).unwrap();
    }
}

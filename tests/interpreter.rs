//! `run_code` end to end: real VMs restored from the `default` and `python-data` templates
//! (built once, cached), the agent's contexts and the IPython driver in the guest.

use std::time::{Duration, Instant};

use base64::Engine;
use ember_agent::protocol::{EndStatus, EventKind, RunCodeRequest};
use ember_runtime::Execution;
use ember_tests::{decode_png, run, sandbox};

fn b64(v: &serde_json::Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(v.as_str().expect("base64 string").trim())
        .expect("valid base64")
}

fn status(x: &Execution) -> EndStatus {
    x.end.as_ref().expect("ended").status
}

/// The reference workflow: a workbook goes in, three cells read it, describe it (HTML and
/// text tables) and plot it (a PNG, with no `show()`), with `df` kept between the cells.
#[test]
fn excel_workflow_gives_tables_and_a_png_chart() {
    let sb = sandbox("python-data");
    // The workbook is made with openpyxl (in the guest), downloaded, and uploaded again under
    // another name: both directions of the file API carry it.
    let make = run(
        &sb,
        "import openpyxl\n\
         wb = openpyxl.Workbook(); ws = wb.active\n\
         ws.append(['month', 'sales', 'cost'])\n\
         for i in range(1, 13): ws.append([i, 100 + 7 * i * i % 31, 50 + i])\n\
         wb.save('/tmp/made.xlsx'); print('saved')",
    );
    assert_eq!(status(&make), EndStatus::Ok, "{make:?}");
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("data.xlsx");
    sb.download("/tmp/made.xlsx", &local).expect("download");
    let bytes = std::fs::read(&local).unwrap();
    assert!(bytes.starts_with(b"PK"), "an xlsx is a zip file");
    sb.upload(&local, "/workspace/data.xlsx").expect("upload");

    let read = run(
        &sb,
        "import pandas as pd\ndf = pd.read_excel('data.xlsx')\nlen(df)",
    );
    assert_eq!(status(&read), EndStatus::Ok, "{read:?}");
    assert_eq!(read.text(), Some("12"), "{read:?}");

    let describe = run(&sb, "df.describe()");
    assert_eq!(status(&describe), EndStatus::Ok, "{describe:?}");
    let bundle = describe.result.as_ref().expect("a result");
    let html = bundle["text/html"].as_str().expect("text/html");
    assert!(html.contains("<table") && html.contains("sales"), "{html}");
    let text = bundle["text/plain"].as_str().expect("text/plain");
    assert!(text.contains("mean") && text.contains("cost"), "{text}");

    let plot = run(&sb, "df.plot(x='month', y=['sales', 'cost'])");
    assert_eq!(status(&plot), EndStatus::Ok, "{plot:?}");
    let pngs = plot.all_with("image/png");
    assert_eq!(pngs.len(), 1, "one figure, sent once: {plot:?}");
    let png = b64(pngs[0]);
    assert!(
        png.len() > 5_000,
        "a real chart, not a blank: {} bytes",
        png.len()
    );
    let (w, h, colours) = decode_png(&png);
    assert!(w >= 300 && h >= 200, "{w}x{h}");
    assert!(
        colours >= 3,
        "the chart has lines and text: {colours} colours"
    );
    // The figure was closed at the end of the cell: the next cell sends no image.
    let after = run(&sb, "1 + 1");
    assert!(after.all_with("image/png").is_empty(), "{after:?}");
    assert_eq!(after.text(), Some("2"));
}

#[test]
fn state_survives_calls_and_a_snapshot_restore() {
    let sb = sandbox("default");
    let x = run(
        &sb,
        "counter = 41\ndef bump():\n    global counter\n    counter += 1\n    return counter",
    );
    assert_eq!(status(&x), EndStatus::Ok, "{x:?}");
    assert_eq!(run(&sb, "bump()").text(), Some("42"));
    // Snapshot the running sandbox, restore it into a second one: both continue on their own.
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    sb.snapshot(&snap).expect("snapshot");
    let opts = ember_runtime::SandboxOptions {
        vmm: Some(ember_tests::bin("ember-vmm")),
        ..Default::default()
    };
    let clone = ember_runtime::Sandbox::restore(&snap, &opts).expect("restore");
    assert_eq!(run(&clone, "bump()").text(), Some("43"));
    assert_eq!(run(&clone, "bump()").text(), Some("44"));
    assert_eq!(
        run(&sb, "bump()").text(),
        Some("43"),
        "the original is independent"
    );
}

#[test]
fn results_displays_and_exceptions_are_events() {
    let sb = sandbox("default");
    let x = run(
        &sb,
        "from IPython.display import display, HTML, Markdown\n\
         display(HTML('<b>bold</b>'))\n\
         display(Markdown('*md*'))\n\
         print('out'); import sys; print('err', file=sys.stderr)\n\
         {'a': 1}",
    );
    assert_eq!(status(&x), EndStatus::Ok, "{x:?}");
    assert_eq!(x.displays.len(), 2, "{x:?}");
    assert_eq!(x.displays[0]["text/html"], "<b>bold</b>");
    assert_eq!(x.displays[1]["text/markdown"], "*md*");
    assert_eq!(x.stdout_text(), "out\n");
    assert_eq!(String::from_utf8_lossy(&x.stderr), "err\n");
    assert_eq!(x.text(), Some("{'a': 1}"));
    let end = x.end.as_ref().unwrap();
    assert!(end.execution_count.is_some(), "{end:?}");

    let e = run(&sb, "def f():\n    raise ValueError('bad value')\nf()");
    assert_eq!(status(&e), EndStatus::Error);
    let exc = e.exception.as_ref().expect("exception event");
    assert_eq!(exc.name, "ValueError");
    assert_eq!(exc.value, "bad value");
    assert!(exc.traceback.join("\n").contains("f()"), "{exc:?}");
    // Magics and shell escapes work.
    let m = run(&sb, "%cd /tmp\n!echo from-shell\nimport os; os.getcwd()");
    assert_eq!(status(&m), EndStatus::Ok, "{m:?}");
    assert!(m.stdout_text().contains("from-shell"), "{m:?}");
    assert_eq!(m.text(), Some("'/tmp'"));
}

/// The busy loop the timeout must stop. On kvm_pvm a guest process that spins in user mode
/// without ever entering the guest kernel starves the whole guest: the interrupts pending for
/// it (its timer tick, the agent's wake-up) are not delivered until the process enters the
/// kernel (measured: `while True: pass` kept a restored or booted guest unresponsive for as
/// long as it ran, also with the VMM kicking the vCPU out of KVM_RUN every 10 ms of CPU).
/// There the loop makes one cheap syscall per iteration; on hardware KVM it is the pure spin.
fn busy_loop() -> &'static str {
    if ember_tests::on_pvm() {
        eprintln!(
            "kvm_pvm: the busy loop makes a syscall per iteration (a pure user-mode spin starves \
             the guest on this host; see the test's doc comment)"
        );
        "import os\nwhile True: os.getppid()"
    } else {
        "while True: pass"
    }
}

#[test]
fn a_timeout_interrupts_the_cell_and_keeps_the_context() {
    let sb = sandbox("default");
    assert_eq!(status(&run(&sb, "kept = 'yes'")), EndStatus::Ok);
    let t = Instant::now();
    let mut x = Execution::default();
    let end = sb
        .run_code(
            &RunCodeRequest {
                code: busy_loop().into(),
                timeout_ms: Some(2000),
                ..Default::default()
            },
            |ev| x.push(ev),
        )
        .expect("run_code");
    let took = t.elapsed();
    assert_eq!(end.status, EndStatus::TimedOut, "{x:?}");
    assert!(took >= Duration::from_secs(2), "stopped early: {took:?}");
    assert!(took < Duration::from_secs(60), "not interrupted: {took:?}");
    assert_eq!(
        x.exception.as_ref().map(|e| e.name.as_str()),
        Some("KeyboardInterrupt")
    );
    assert_eq!(run(&sb, "kept").text(), Some("'yes'"));
}

#[test]
fn a_dead_context_is_reported_and_the_next_call_gets_a_fresh_one() {
    let sb = sandbox("default");
    assert_eq!(status(&run(&sb, "before = 1")), EndStatus::Ok);
    let x = run(&sb, "import os; os._exit(1)");
    assert_eq!(status(&x), EndStatus::ContextDied, "{x:?}");
    let mut restarted = false;
    let mut y = Execution::default();
    sb.run_code(
        &RunCodeRequest {
            code: "'before' in globals(), 6 * 7".into(),
            ..Default::default()
        },
        |ev| {
            if matches!(ev, EventKind::ContextRestarted { .. }) {
                restarted = true;
            }
            y.push(ev)
        },
    )
    .expect("run_code after the death");
    assert!(restarted, "the restart is reported: {y:?}");
    assert_eq!(y.text(), Some("(False, 42)"), "fresh state: {y:?}");
}

#[test]
fn stdout_streams_while_the_cell_runs() {
    let sb = sandbox("default");
    let t = Instant::now();
    let mut arrivals = Vec::new();
    let end = sb
        .run_code(
            &RunCodeRequest {
                code: "import time\nfor i in range(3):\n    print(i)\n    time.sleep(1.5)".into(),
                ..Default::default()
            },
            |ev| {
                if let EventKind::Stdout { data } = ev {
                    arrivals.push((t.elapsed(), String::from_utf8_lossy(data).into_owned()));
                }
            },
        )
        .expect("run_code");
    let total = t.elapsed();
    assert_eq!(end.status, EndStatus::Ok);
    let first = arrivals.first().expect("output arrived");
    assert!(first.1.starts_with('0'), "{arrivals:?}");
    assert!(
        first.0 + Duration::from_secs(2) < total,
        "the first line came {:?} into a {total:?} cell: not streamed",
        first.0
    );
}

#[test]
fn bash_contexts_keep_cwd_and_variables() {
    let sb = sandbox("default");
    let ctx = sb.context_create("bash", None).expect("bash context");
    let bash = |code: &str| {
        let mut x = Execution::default();
        let end = sb
            .run_code(
                &RunCodeRequest {
                    code: code.into(),
                    context: Some(ctx.clone()),
                    ..Default::default()
                },
                |ev| x.push(ev),
            )
            .expect("run_code in bash");
        x.end = Some(end);
        x
    };
    assert_eq!(
        status(&bash("mkdir -p /tmp/b && cd /tmp/b && GREETING=hello")),
        EndStatus::Ok
    );
    let x = bash("pwd; echo $GREETING");
    assert_eq!(x.stdout_text(), "/tmp/b\nhello\n", "{x:?}");
    let x = bash("false");
    assert_eq!(
        status(&x),
        EndStatus::Error,
        "a failing command is an error: {x:?}"
    );
    // A long job is interrupted by the timeout; the shell survives with its state.
    let mut y = Execution::default();
    let end = sb
        .run_code(
            &RunCodeRequest {
                code: "sleep 600".into(),
                context: Some(ctx.clone()),
                timeout_ms: Some(1500),
                ..Default::default()
            },
            |ev| y.push(ev),
        )
        .expect("run_code");
    assert_eq!(end.status, EndStatus::TimedOut, "{y:?}");
    assert_eq!(bash("echo $GREETING; pwd").stdout_text(), "hello\n/tmp/b\n");
    // The python default context is untouched by all this.
    assert_eq!(run(&sb, "2 ** 10").text(), Some("1024"));
}

#[test]
fn bad_requests_get_clear_errors_and_the_sandbox_goes_on() {
    let sb = sandbox("default");
    let err = sb
        .run_code(
            &RunCodeRequest {
                code: "1".into(),
                context: Some("no-such-context".into()),
                ..Default::default()
            },
            |_| {},
        )
        .expect_err("unknown context");
    let msg = err.to_string();
    assert!(msg.contains("no-such-context"), "{msg}");
    assert_eq!(run(&sb, "3 * 3").text(), Some("9"));
}

/// The guest's clocks stay right across restores and a tickless idle period, the cases where
/// the guest kernel takes many pending seconds in one step (guest-kernel patch 0011).
/// CLOCK_MONOTONIC and CLOCK_MONOTONIC_RAW run from the same counter and differ by a constant
/// (the boot offset MONOTONIC starts from), so that difference moves by whole seconds only if
/// seconds were lost or counted twice; and the monotonic time the guest sees pass while it
/// sits idle matches the host's.
#[test]
fn guest_clocks_agree_after_restores_and_an_idle_period() {
    let sb = sandbox("default");
    // (CLOCK_MONOTONIC, its difference from CLOCK_MONOTONIC_RAW, CLOCK_REALTIME), in seconds.
    let clocks = |sb: &ember_runtime::Sandbox| -> (f64, f64, f64) {
        let x = run(
            sb,
            "import time\n\
             _m = time.clock_gettime(time.CLOCK_MONOTONIC)\n\
             _r = time.clock_gettime(time.CLOCK_MONOTONIC_RAW)\n\
             f'{_m!r} {_r!r} {time.time()!r}'",
        );
        assert_eq!(status(&x), EndStatus::Ok, "{x:?}");
        let text = x.text().expect("a result").trim_matches('\'').to_string();
        let v: Vec<f64> = text
            .split(' ')
            .map(|s| s.parse().unwrap_or_else(|e| panic!("{text:?}: {e}")))
            .collect();
        assert_eq!(v.len(), 3, "{text:?}");
        (v[0], v[0] - v[1], v[2])
    };
    let host_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    // Restored from the shared template, built seconds to hours ago.
    let before_first = Instant::now();
    let (mono1, offset1, wall1) = clocks(&sb);
    let after_first = Instant::now();
    assert!(
        (wall1 - host_now()).abs() < 30.0,
        "guest wall clock {wall1} vs host {}",
        host_now()
    );
    // Idle long enough for several whole seconds to be pending when the guest next wakes.
    std::thread::sleep(Duration::from_secs(6));
    let before_second = Instant::now();
    let (mono2, offset2, _) = clocks(&sb);
    let after_second = Instant::now();
    assert!(
        (offset2 - offset1).abs() < 0.05,
        "over an idle period CLOCK_MONOTONIC - CLOCK_MONOTONIC_RAW went from {offset1} to {offset2}"
    );
    // The guest read its clocks somewhere inside each call: the time that passed for it lies
    // between the host's gap between the calls and the host's span over both.
    let guest = mono2 - mono1;
    let least = before_second.duration_since(after_first).as_secs_f64();
    let most = after_second.duration_since(before_first).as_secs_f64();
    assert!(
        guest >= least - 0.05 && guest <= most + 0.05,
        "the guest's monotonic clock advanced {guest:.3} s while {least:.3}..{most:.3} s passed \
         on the host"
    );
    // A snapshot of this sandbox restored a few seconds later: whatever the restore does to
    // the guest's counter (on kvm_pvm it jumps by the seconds in between), the two clocks still
    // agree and the monotonic clock did not go back.
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap");
    sb.snapshot(&snap).expect("snapshot");
    std::thread::sleep(Duration::from_secs(3));
    let opts = ember_runtime::SandboxOptions {
        vmm: Some(ember_tests::bin("ember-vmm")),
        ..Default::default()
    };
    let clone = ember_runtime::Sandbox::restore(&snap, &opts).expect("restore");
    let (mono3, offset3, _) = clocks(&clone);
    assert!(
        (offset3 - offset1).abs() < 0.05,
        "across a restore CLOCK_MONOTONIC - CLOCK_MONOTONIC_RAW went from {offset1} to {offset3}"
    );
    assert!(
        mono3 > mono2,
        "the clone's monotonic clock {mono3} is behind the snapshot's {mono2}"
    );
}

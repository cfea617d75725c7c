//! Templates as code: a build is cached by the hash of its inputs — a rebuild with nothing
//! changed is a no-op, a changed recipe builds a new snapshot that sandboxes then start from.

use std::time::Instant;

use ember_runtime::{BuildEvent, BuildOptions, Sandbox, SandboxOptions, Template};
use ember_tests::{bin, kernel, run, template};

fn opts() -> BuildOptions {
    BuildOptions {
        kernel: Some(kernel()),
        vmm: Some(bin("ember-vmm")),
        ..Default::default()
    }
}

fn build(name: &str, recipe: Option<&std::path::Path>) -> (Template, bool) {
    let mut up_to_date = false;
    let mut o = opts();
    o.recipe = recipe.map(|p| p.to_path_buf());
    let t = Template::build(name, &o, &mut |ev| {
        eprintln!("[{name}] {ev:?}");
        if matches!(ev, BuildEvent::UpToDate) {
            up_to_date = true;
        }
    })
    .unwrap_or_else(|e| panic!("build {name}: {e}"));
    (t, up_to_date)
}

#[test]
fn unchanged_is_a_no_op_and_a_changed_recipe_rebuilds() {
    let first = template("default");
    let t = Instant::now();
    let (again, up_to_date) = build("default", None);
    assert!(up_to_date, "an unchanged template was rebuilt");
    assert_eq!(again.info.key, first.info.key);
    assert_eq!(
        again.info.built_at, first.info.built_at,
        "the record was rewritten"
    );
    eprintln!("no-op rebuild took {:?}", t.elapsed());

    // The same recipe with another warm-up: a new key, a real build, and sandboxes from it
    // carry what the new warm-up did.
    let src = ember_runtime::images::source_root().unwrap();
    let recipe = std::fs::read_to_string(src.join("rootfs/templates/default.toml")).unwrap();
    let marker = format!("changed-{}", ember_runtime::paths::random_id());
    let warm = format!("code = \"open('/tmp/warm.txt', 'w').write('{marker}')\"");
    let mut lines: Vec<String> = Vec::new();
    let mut in_warmup = false;
    for line in recipe.lines() {
        if line.trim_start().starts_with('[') {
            in_warmup = line.trim() == "[warmup]";
        }
        if in_warmup && line.trim_start().starts_with("code") {
            lines.push(warm.clone());
        } else {
            lines.push(line.to_string());
        }
    }
    assert!(
        lines.contains(&warm),
        "the recipe has a [warmup] code line to change"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("default-changed.toml");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();

    let (changed, up_to_date) = build("test-changed", Some(&path));
    assert!(!up_to_date, "a changed recipe was not rebuilt");
    assert_ne!(changed.info.key, first.info.key);
    assert_eq!(
        changed.info.image_key, first.info.image_key,
        "only the warm-up changed: the root image is shared"
    );
    let sb = Sandbox::create(
        &changed,
        &SandboxOptions {
            vmm: Some(bin("ember-vmm")),
            ..Default::default()
        },
    )
    .expect("sandbox from the changed template");
    let x = run(&sb, "open('/tmp/warm.txt').read()");
    assert_eq!(x.text(), Some(format!("'{marker}'").as_str()), "{x:?}");
    drop(sb);
    let (_, up_to_date) = build("test-changed", Some(&path));
    assert!(
        up_to_date,
        "the changed template, unchanged since, was rebuilt"
    );
    Template::remove("test-changed").expect("remove");
    assert!(Template::open("test-changed").is_err());
    assert!(!changed.dir.exists(), "the build's directory is gone");
    // The default template is untouched by removing another.
    Template::open("default").expect("default still there");
}

/// A template's snapshot is taken without a jail; `ember vm restore --jail` re-maps its host
/// paths (the overlay's base image, the vsock socket) into the jail and the guest runs there.
#[test]
fn a_template_snapshot_restores_inside_a_jail() {
    let t = template("default");
    let base = tempfile::tempdir().unwrap();
    let sock = base.path().join("api.sock");
    let jails = base.path().join("jails");
    let mut child = std::process::Command::new(bin("ember"))
        .args([
            "vm",
            "restore",
            "--jail",
            "--jail-uid",
            "10124",
            "--jail-gid",
            "10124",
        ])
        .arg("--jail-base")
        .arg(&jails)
        .arg("--snapshot")
        .arg(t.snapshot_dir())
        .arg("--api-sock")
        .arg(&sock)
        .args(["--timeout", "120"])
        .env("EMBER_VMM", bin("ember-vmm"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let stats = loop {
        let out = std::process::Command::new(bin("ember"))
            .args(["vm", "stats", "--api-sock"])
            .arg(&sock)
            .output()
            .unwrap();
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).into_owned();
        }
        if let Ok(Some(st)) = child.try_wait() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("jailed restore exited ({st}): {err}");
        }
        assert!(t0.elapsed().as_secs() < 60, "no control socket");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(stats.contains("vcpu") || stats.contains("exits"), "{stats}");
    let out = std::process::Command::new(bin("ember"))
        .args(["vm", "shutdown", "--api-sock"])
        .arg(&sock)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("jailed as"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&jails)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "jail dirs left behind: {left:?}");
}

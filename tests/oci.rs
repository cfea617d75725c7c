//! Templates from OCI/Docker images (docs/images.md), end to end: images made here (from the
//! cached `default` template's Debian tree and from Debian's static busybox, by
//! `tests/oci/mkimage.py`), served by Debian's `docker-registry` in a network namespace this
//! test creates (nothing leaves the machine), built with `ember template build --from-image`
//! and used through sandboxes. Hostile layers are refused or neutralised with the host
//! directory outside the build untouched. A Dockerfile FROM the Debian image runs its steps
//! in a build VM (pip install from a package index in a network namespace this test creates,
//! COPY with .dockerignore, ENV, WORKDIR, USER), and an edit of its last step reruns only it.
//!
//! Needs root (namespaces, KVM, the cache), `docker-registry`, `busybox` (busybox-static), `ip`
//! and `tar` (scripts/test-prereqs.sh installs them).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use ember_agent::protocol::{EventKind, ExecRequest};
use ember_tests::{bin, is_root, kernel, missing_tools, skip};

const MKIMAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/oci/mkimage.py");

fn prerequisites(test: &str) -> bool {
    if !is_root() {
        skip(
            test,
            "needs root (network namespace, KVM, the template cache)",
        );
        return false;
    }
    let missing = missing_tools(&[("ip", "-V"), ("tar", "--version"), ("python3", "--version")]);
    let mut missing: Vec<String> = missing.into_iter().map(String::from).collect();
    for p in ["/usr/bin/docker-registry", "/bin/busybox"] {
        if !Path::new(p).is_file() {
            missing.push(p.into());
        }
    }
    if !missing.is_empty() {
        skip(
            test,
            &format!(
                "missing {} (scripts/test-prereqs.sh installs docker-registry and busybox-static)",
                missing.join(", ")
            ),
        );
        return false;
    }
    true
}

fn mkimage(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(MKIMAGE)
        .args(args)
        .output()
        .expect("run mkimage.py");
    assert!(
        out.status.success(),
        "mkimage.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `ember template build NAME --from-image REF --json ...` (in `netns` when given).
fn build(
    netns: Option<&str>,
    name: &str,
    reference: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let k = kernel();
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(bin("ember"));
            c
        }
        None => Command::new(bin("ember")),
    };
    cmd.args([
        "template",
        "build",
        name,
        "--from-image",
        reference,
        "--json",
        "--kernel",
    ])
    .arg(&k)
    .args(extra)
    .env("EMBER_VMM", bin("ember-vmm"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let out = cmd.output().expect("run ember template build");
    eprintln!(
        "ember template build {name} --from-image {reference} {extra:?}: {:?} in {:.1}s\n{}",
        out.status,
        t0.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn built_key(out: &Output) -> (String, bool) {
    assert!(
        out.status.success(),
        "the build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    (
        v["template"]["key"].as_str().expect("key").to_string(),
        v["up_to_date"].as_bool().unwrap_or(false),
    )
}

/// A directory outside every build with a canary file; `check` asserts nothing changed.
struct Outside {
    path: PathBuf,
    /// Removed with the test (a fresh one).
    _dir: Option<tempfile::TempDir>,
}

impl Outside {
    /// A fresh one. Not under /tmp: the guest mounts a tmpfs there, which would hide what an
    /// image carries at that path.
    fn new() -> Outside {
        let d = tempfile::Builder::new()
            .prefix("ember-oci-outside-")
            .tempdir_in("/var/tmp")
            .expect("tempdir");
        std::fs::write(d.path().join("canary"), "unchanged").expect("canary");
        Outside {
            path: d.path().to_path_buf(),
            _dir: Some(d),
        }
    }

    /// One at a fixed path (images that name it are the same run after run, so their
    /// templates stay cached), checked unchanged first.
    fn fixed(path: &str) -> Outside {
        let o = Outside {
            path: PathBuf::from(path),
            _dir: None,
        };
        if !o.path.join("canary").exists() {
            std::fs::create_dir_all(&o.path).expect("mkdir");
            std::fs::write(o.path.join("canary"), "unchanged").expect("canary");
        }
        o.check();
        o
    }

    fn path(&self) -> &str {
        self.path.to_str().expect("utf-8")
    }
    fn check(&self) {
        let names: Vec<_> = std::fs::read_dir(&self.path)
            .expect("read")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("canary")],
            "something was written outside the build"
        );
        assert_eq!(
            std::fs::read_to_string(self.path.join("canary")).expect("canary"),
            "unchanged"
        );
        assert_eq!(
            std::fs::metadata(self.path.join("canary"))
                .map(|m| std::os::unix::fs::MetadataExt::nlink(&m))
                .unwrap_or(0),
            1
        );
    }
}

/// The busybox tree (Debian's static busybox and its applet links) as a layer directory.
fn busybox_tree(dir: &Path) -> PathBuf {
    let tree = dir.join("bbtree");
    std::fs::create_dir_all(tree.join("bin")).expect("mkdir");
    std::fs::create_dir_all(tree.join("etc")).expect("mkdir");
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).expect("copy busybox");
    let list = Command::new("/bin/busybox")
        .arg("--list")
        .output()
        .expect("busybox --list");
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" && !applet.is_empty() {
            let _ = std::os::unix::fs::symlink("busybox", tree.join("bin").join(applet));
        }
    }
    std::fs::write(tree.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").expect("passwd");
    tree
}

fn sandbox(name: &str) -> ember_runtime::Sandbox {
    let t = ember_runtime::Template::open(name).unwrap_or_else(|e| panic!("template {name}: {e}"));
    let opts = ember_runtime::SandboxOptions {
        vmm: Some(bin("ember-vmm")),
        ..Default::default()
    };
    ember_runtime::Sandbox::create(&t, &opts).unwrap_or_else(|e| panic!("sandbox from {name}: {e}"))
}

fn exec(sb: &ember_runtime::Sandbox, script: &str) -> String {
    let req = ExecRequest::new(["/bin/sh", "-c", script]);
    let mut out = String::new();
    let mut err = String::new();
    sb.exec(&req, |ev| match ev {
        EventKind::Stdout { data } => out.push_str(&String::from_utf8_lossy(data)),
        EventKind::Stderr { data } => err.push_str(&String::from_utf8_lossy(data)),
        _ => {}
    })
    .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    assert!(err.is_empty(), "exec {script:?} wrote to stderr: {err}");
    out
}

/// The cached `default` template's Debian tree (newest build of it in the cache), else the one
/// the default rootfs build makes.
fn default_tree() -> PathBuf {
    let cache =
        PathBuf::from(std::env::var("EMBER_CACHE").unwrap_or_else(|_| "/var/cache/ember".into()));
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir(cache.join("rootfs-template")) {
        for e in entries.flatten() {
            let m = e.path().join("manifest.json");
            let Ok(text) = std::fs::read_to_string(&m) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if v["template"] != "default" {
                continue;
            }
            let Some(base) = v["base_key"].as_str() else {
                continue;
            };
            let tree = cache.join("rootfs-base").join(base).join("tree");
            let t = std::fs::metadata(&m)
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            if tree.join("usr/bin/python3").exists() && best.as_ref().is_none_or(|(b, _)| t > *b) {
                best = Some((t, tree));
            }
        }
    }
    if let Some((_, t)) = best {
        return t;
    }
    let img = ember_tests::rootfs();
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(img.with_file_name("manifest.json")).expect("manifest"),
    )
    .expect("json");
    cache
        .join("rootfs-base")
        .join(m["base_key"].as_str().expect("base_key"))
        .join("tree")
}

/// The Debian test image as an OCI layout in `work`. Layer 1: the default template's Debian
/// tree (Python + IPython), uncompressed; layer 2 (gzip): the app directory and a file, with
/// fixed mtimes, so that a run with the same cached tree makes the same image and finds what
/// was built from it (its unpacked tree, its templates) in the cache. The Dockerfile test
/// starts from the same image, so the two share its unpacked tree.
fn debian_layout(work: &Path) -> PathBuf {
    let tree = default_tree();
    let app = work.join("app");
    std::fs::create_dir_all(app.join("srv/app")).expect("mkdir");
    std::fs::write(app.join("srv/app/hello.txt"), "hello from the image\n").expect("write");
    let layout = work.join("layout");
    mkimage(&[
        "layout",
        layout.to_str().expect("utf-8"),
        "--layer-dir",
        tree.to_str().expect("utf-8"),
        "--layer-dir-fixed",
        app.to_str().expect("utf-8"),
        "--gzip-last",
        "--env",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--env",
        "EMBER_OCI_TEST=from-image",
        "--workdir",
        "/srv/app",
        "--cmd",
        "/bin/sh",
    ]);
    layout
}

/// A registry (Debian's docker-registry) on 127.0.0.1:5000 in a network namespace of its own.
struct Registry {
    ns: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Registry {
    fn start() -> Registry {
        let ns = format!("ember-oci-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let ok = Command::new("ip")
            .args(["netns", "add", &ns])
            .status()
            .expect("ip netns add");
        assert!(ok.success(), "ip netns add {ns}");
        let ok = Command::new("ip")
            .args(["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])
            .status()
            .expect("ip");
        assert!(ok.success());
        let dir = tempfile::Builder::new()
            .prefix("ember-oci-registry-")
            .tempdir()
            .expect("tempdir");
        let cfg = dir.path().join("config.yml");
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:5000\n",
                dir.path().join("data").display()
            ),
        )
        .expect("registry config");
        let log = std::fs::File::create(dir.path().join("registry.log")).expect("log");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "/usr/bin/docker-registry", "serve"])
            .arg(&cfg)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start docker-registry");
        let r = Registry {
            ns,
            child,
            _dir: dir,
        };
        let t0 = Instant::now();
        loop {
            let probe = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &r.ns,
                    "python3",
                    "-c",
                    "import urllib.request as u; u.urlopen('http://127.0.0.1:5000/v2/', timeout=2)",
                ])
                .output()
                .expect("probe");
            if probe.status.success() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the registry did not answer in 30 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        r
    }

    fn push(&self, layout: &Path, repo: &str, tag: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", MKIMAGE, "push"])
            .arg(layout)
            .args(["127.0.0.1:5000", repo, tag])
            .output()
            .expect("push");
        assert!(
            out.status.success(),
            "push: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

#[test]
fn registry_image_becomes_a_template_that_runs_code_and_exec_and_archives_share_its_key() {
    let test =
        "registry_image_becomes_a_template_that_runs_code_and_exec_and_archives_share_its_key";
    if !prerequisites(test) {
        return;
    }
    let t0 = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("ember-oci-test-")
        .tempdir()
        .expect("tempdir");
    let layout = debian_layout(work.path());
    eprintln!("image made in {:.1}s", t0.elapsed().as_secs_f64());
    let registry = Registry::start();
    let digest = registry.push(&layout, "ember/debian", "v1");
    eprintln!(
        "pushed ember/debian:v1 = {digest} ({:.1}s)",
        t0.elapsed().as_secs_f64()
    );

    let name = "oci-test-debian";
    let reference = format!("127.0.0.1:5000/ember/debian:v1@{digest}");
    let (key, _) = built_key(&build(Some(&registry.ns), name, &reference, &[], &[]));
    eprintln!(
        "built from the registry: {key} ({:.1}s)",
        t0.elapsed().as_secs_f64()
    );

    // The same image as `docker save` and OCI archives (and the layout): the same key, and
    // nothing to build again.
    let da = work.path().join("image-docker.tar");
    let oa = work.path().join("image-oci.tar");
    mkimage(&[
        "docker-archive",
        layout.to_str().expect("utf-8"),
        da.to_str().expect("utf-8"),
    ]);
    mkimage(&[
        "oci-archive",
        layout.to_str().expect("utf-8"),
        oa.to_str().expect("utf-8"),
    ]);
    for r in [
        format!("docker-archive:{}", da.display()),
        format!("oci-archive:{}", oa.display()),
        format!("oci:{}", layout.display()),
    ] {
        let (k, up_to_date) = built_key(&build(None, name, &r, &[], &[]));
        assert_eq!(k, key, "{r} gives another template key");
        assert!(up_to_date, "{r}: the same image was built again");
    }
    eprintln!("archives checked ({:.1}s)", t0.elapsed().as_secs_f64());

    let sb = sandbox(name);
    let ex = sb
        .run("import os, sys, IPython\nprint(os.environ['EMBER_OCI_TEST'], os.getcwd(), sys.version_info >= (3, 8))\n6 * 7")
        .expect("run_code");
    assert!(
        ex.exception.is_none(),
        "run_code raised: {:?}",
        ex.exception
    );
    assert_eq!(
        String::from_utf8_lossy(&ex.stdout).trim(),
        "from-image /srv/app True"
    );
    assert_eq!(
        ex.result
            .as_ref()
            .and_then(|r| r.get("text/plain"))
            .and_then(|v| v.as_str()),
        Some("42")
    );
    assert_eq!(
        exec(
            &sb,
            "cat /srv/app/hello.txt; test -x /sbin/init && echo init-ok"
        ),
        "hello from the image\ninit-ok\n"
    );
    let _ = sb.kill();
    eprintln!("{test}: {:.1}s", t0.elapsed().as_secs_f64());
}

fn busybox_layout(work: &Path, outside: &Outside, hostile: Option<&str>) -> PathBuf {
    let tree = busybox_tree(work);
    let layout = work.join(format!("layout-{}", hostile.unwrap_or("plain")));
    let mut args: Vec<String> = vec![
        "layout".into(),
        layout.display().to_string(),
        "--layer-dir-fixed".into(),
        tree.display().to_string(),
    ];
    if let Some(kind) = hostile {
        let t = work.join(format!("{kind}.tar"));
        mkimage(&[
            "hostile",
            kind,
            t.to_str().expect("utf-8"),
            "--outside",
            outside.path(),
        ]);
        args.extend(["--layer-tar".into(), t.display().to_string()]);
    }
    args.extend([
        "--env".into(),
        "PATH=/bin".into(),
        "--cmd".into(),
        "/bin/sh".into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    mkimage(&args);
    layout
}

#[test]
fn busybox_image_without_python_execs_and_files_and_refuses_run_code_at_build() {
    let test = "busybox_image_without_python_execs_and_files_and_refuses_run_code_at_build";
    if !prerequisites(test) {
        return;
    }
    let t0 = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("ember-oci-test-")
        .tempdir()
        .expect("tempdir");
    let outside = Outside::fixed("/var/tmp/ember-oci-outside-busybox");
    // The busybox image carries what is neutralised rather than refused: a setuid file,
    // device nodes and a FIFO, a symlink to the host directory with a write through it.
    let layout = busybox_layout(work.path(), &outside, Some("neutralised"));
    let reference = format!("oci:{}", layout.display());
    let name = "oci-test-busybox";

    let out = build(None, name, &reference, &[], &[]);
    assert!(
        !out.status.success(),
        "a template with run_code was built from an image without Python"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    for want in ["run_code needs Python", "pip install ipython", "--no-code"] {
        assert!(
            err.contains(want),
            "the refusal does not say {want:?}: {err}"
        );
    }
    assert!(
        !err.contains("booting"),
        "refused only after booting a VM: {err}"
    );
    // The tree was unpacked (and cached) before the refusal: its notes are in this log.
    assert!(
        err.contains("cleared setuid/setgid bits on 1 file(s): /bin/suid-sh"),
        "{err}"
    );
    assert!(err.contains("dropped 3 device node(s)/FIFO(s)"), "{err}");

    built_key(&build(None, name, &reference, &["--no-code"], &[]));
    outside.check();

    let sb = sandbox(name);
    assert_eq!(exec(&sb, "echo hi from busybox"), "hi from busybox\n");
    assert_eq!(exec(&sb, "stat -c %a /bin/suid-sh"), "755\n");
    assert_eq!(exec(&sb, "ls -A /dev-in-image 2>/dev/null | wc -l"), "0\n");
    // The write through the symlink landed inside the image, at the path the guest sees.
    assert_eq!(
        exec(&sb, &format!("cat {}/canary", outside.path())),
        "pwned"
    );
    sb.write_file("/workspace/note.txt", &mut &b"files work"[..])
        .expect("write_file");
    let mut back = Vec::new();
    sb.read_file("/workspace/note.txt", &mut back)
        .expect("read_file");
    assert_eq!(back, b"files work");
    let ex = sb.run("1 + 1");
    assert!(
        ex.is_err() || ex.as_ref().is_ok_and(|e| e.exception.is_some()),
        "run_code worked without Python: {ex:?}"
    );
    let _ = sb.kill();
    outside.check();
    eprintln!("{test}: {:.1}s", t0.elapsed().as_secs_f64());
}

#[test]
fn hostile_layers_are_refused_and_the_host_is_unchanged() {
    let test = "hostile_layers_are_refused_and_the_host_is_unchanged";
    if !prerequisites(test) {
        return;
    }
    let t0 = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("ember-oci-test-")
        .tempdir()
        .expect("tempdir");
    let outside = Outside::new();
    // (kind of hostile layer, what the error must say, environment of the build)
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);
    let cases: &[Case] = &[
        ("dotdot", "a '..' component", &[]),
        ("absolute", "an absolute name", &[]),
        ("hardlink-out", "hard link target", &[]),
        (
            "symlink-dangling",
            "symlink to a directory that does not exist in the image",
            &[],
        ),
        ("sparse-10g", "10737418240 bytes, over the cap", &[]),
        (
            "tar-bomb",
            "more than 5000 entries",
            &[("EMBER_IMAGE_MAX_ENTRIES", "5000")],
        ),
    ];
    for (kind, want, env) in cases {
        let layout = busybox_layout(work.path(), &outside, Some(kind));
        let out = build(
            None,
            &format!("oci-test-hostile-{kind}"),
            &format!("oci:{}", layout.display()),
            &["--no-code"],
            env,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{kind}: built");
        assert!(
            err.contains(want),
            "{kind}: the error does not say {want:?}: {err}"
        );
        outside.check();
    }
    // Digest mismatches: a layer blob and a manifest that do not hash to their names.
    for what in ["layer", "manifest"] {
        let layout = busybox_layout(work.path(), &outside, Some("unique"));
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(layout.join("index.json")).expect("index"),
        )
        .expect("json");
        let mdig = index["manifests"][0]["digest"]
            .as_str()
            .expect("digest")
            .trim_start_matches("sha256:")
            .to_string();
        let mpath = layout.join("blobs/sha256").join(&mdig);
        let target = if what == "manifest" {
            mpath
        } else {
            let m: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&mpath).expect("manifest")).expect("json");
            layout.join("blobs/sha256").join(
                m["layers"][1]["digest"]
                    .as_str()
                    .expect("digest")
                    .trim_start_matches("sha256:"),
            )
        };
        let mut bytes = std::fs::read(&target).expect("blob");
        // A byte changed inside (JSON stays JSON: a space becomes a newline).
        let i = bytes.iter().position(|&b| b == b' ').unwrap_or(0);
        bytes[i] = if bytes[i] == b' ' {
            b'\n'
        } else {
            bytes[i] ^ 1
        };
        std::fs::write(&target, bytes).expect("tamper");
        let out = build(
            None,
            &format!("oci-test-hostile-{what}-digest"),
            &format!("oci:{}", layout.display()),
            &["--no-code"],
            &[],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("digest mismatch"),
            "{what}: {err}"
        );
        outside.check();
    }
    eprintln!("{test}: {:.1}s", t0.elapsed().as_secs_f64());
}

/// A pure-Python wheel (`embertestpkg` 1.0) made here with Python's zipfile: no network, no
/// build tools.
const MKWHEEL: &str = r#"
import base64, hashlib, sys, zipfile
out = sys.argv[1]
name, ver = "embertestpkg", "1.0"
files = {
    f"{name}/__init__.py": 'VALUE = "from-the-local-index"\n',
    f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
    f"{name}-{ver}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ember-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = f"{name}-{ver}.dist-info/RECORD"
lines = []
with zipfile.ZipFile(f"{out}/{name}-{ver}-py3-none-any.whl", "w") as z:
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
        z.writestr(zipfile.ZipInfo(path, (1980, 1, 1, 0, 0, 0)), data)
    lines.append(f"{record},,")
    z.writestr(zipfile.ZipInfo(record, (1980, 1, 1, 0, 0, 0)), "\n".join(lines) + "\n")
"#;

/// A package index (a static wheel directory behind Python's http.server) on port 8000 of a
/// network namespace of its own; a build whose `--build-netns` is that namespace reaches it
/// at the build link's gateway address.
struct PackageIndex {
    ns: String,
    child: std::process::Child,
}

impl PackageIndex {
    fn start(dir: &Path) -> PackageIndex {
        let ns = format!("ember-df-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        for args in [
            vec!["netns", "add", &ns],
            vec!["netns", "exec", &ns, "ip", "link", "set", "lo", "up"],
        ] {
            let ok = Command::new("ip").args(&args).status().expect("ip");
            assert!(ok.success(), "ip {args:?}");
        }
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-m", "http.server", "8000"])
            .args(["--bind", "0.0.0.0", "--directory"])
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the index");
        let index = PackageIndex { ns, child };
        let t0 = Instant::now();
        loop {
            let probe = Command::new("ip")
                .args(["netns", "exec", &index.ns, "python3", "-c"])
                .arg("import urllib.request as u; u.urlopen('http://127.0.0.1:8000/simple/', timeout=2)")
                .output()
                .expect("probe");
            if probe.status.success() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the package index did not answer in 30 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        index
    }
}

impl Drop for PackageIndex {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// `ember template build NAME --dockerfile ... --json`: (key, stderr, seconds).
fn build_dockerfile(name: &str, context: &Path, extra: &[&str]) -> (String, String, f64) {
    let t0 = Instant::now();
    let out = Command::new(bin("ember"))
        .args(["template", "build", name, "--json", "--dockerfile"])
        .arg(context.join("Dockerfile"))
        .arg("--kernel")
        .arg(kernel())
        .args(extra)
        .env("EMBER_VMM", bin("ember-vmm"))
        .output()
        .expect("run ember template build --dockerfile");
    let secs = t0.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "ember template build {name} --dockerfile: {:?} in {secs:.1}s\n{err}",
        out.status
    );
    let (key, _) = built_key(&out);
    (key, err, secs)
}

#[test]
fn dockerfile_steps_run_in_a_vm_are_cached_and_the_sandbox_sees_them() {
    let test = "dockerfile_steps_run_in_a_vm_are_cached_and_the_sandbox_sees_them";
    if !prerequisites(test) {
        return;
    }
    // pip runs in the guest from Debian's pip wheel (the Debian tree has Python, not pip).
    let pip = std::fs::read_dir("/usr/share/python-wheels")
        .ok()
        .and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("/pip-"))
        });
    let Some(pip) = pip else {
        skip(
            test,
            "no /usr/share/python-wheels/pip-*.whl (python3-pip-whl, which python3-venv pulls \
             in; scripts/test-prereqs.sh installs python3-venv)",
        );
        return;
    };
    let t0 = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("ember-df-test-")
        .tempdir()
        .expect("tempdir");
    let layout = debian_layout(work.path());
    // The index: /simple/embertestpkg/<wheel>, listed by http.server.
    let pkgdir = work.path().join("index/simple/embertestpkg");
    std::fs::create_dir_all(&pkgdir).expect("mkdir");
    let ok = Command::new("python3")
        .args(["-c", MKWHEEL])
        .arg(&pkgdir)
        .status()
        .expect("python3");
    assert!(ok.success(), "making the wheel");
    let index = PackageIndex::start(&work.path().join("index"));
    // The context: pip's wheel, an app directory with a file .dockerignore leaves out.
    let ctx = work.path().join("ctx");
    std::fs::create_dir_all(ctx.join("app")).expect("mkdir");
    std::fs::copy(&pip, ctx.join("pip.whl")).expect("copy pip");
    std::fs::write(ctx.join("app/main.py"), "print('app')\n").expect("write");
    std::fs::write(ctx.join("app/debug.log"), "not for the image\n").expect("write");
    std::fs::write(ctx.join(".dockerignore"), "**/*.log\n").expect("write");
    let dockerfile = |last: &str| {
        format!(
            "FROM oci:{}\n\
             ARG INDEX=http://172.30.0.1:8000/simple/\n\
             ENV EMBER_DF=from-dockerfile\n\
             WORKDIR /srv/app\n\
             COPY pip.whl /opt/pip.whl\n\
             RUN python3 /opt/pip.whl/pip install --no-cache-dir --disable-pip-version-check \\\n\
                 --break-system-packages --index-url \"$INDEX\" --trusted-host 172.30.0.1 embertestpkg\n\
             COPY app/ ./\n\
             RUN chown user /srv/app\n\
             USER user\n\
             RUN whoami > /srv/app/whoami && echo {last} > /srv/app/last\n",
            layout.display()
        )
    };
    let name = "oci-test-dockerfile";
    std::fs::write(ctx.join("Dockerfile"), dockerfile("first")).expect("write");
    // Exec and files only (no code contexts: no warm-up, a short build); run_code in a
    // template built from a Dockerfile is the E2B template test's (tests/e2b.rs).
    let netns = ["--build-netns", index.ns.as_str(), "--no-code"];
    let (_, _, first) = build_dockerfile(name, &ctx, &netns);
    // The last step edited (a new value every run, so that it is always rebuilt): only it
    // runs again.
    let marker = format!(
        "edited-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    std::fs::write(ctx.join("Dockerfile"), dockerfile(&marker)).expect("write");
    let (_, err, second) = build_dockerfile(name, &ctx, &netns);
    assert!(
        err.contains("steps: 1 run, 5 cached"),
        "editing the last step ran more than it: {err}"
    );
    assert!(
        err.contains("pip install") && err.contains(": cached"),
        "{err}"
    );
    eprintln!(
        "Dockerfile build: first {first:.1}s (all cached when the image's steps ran before), \
         after editing the last step {second:.1}s"
    );

    // ENV is the template's environment (what its code contexts and E2B's commands get).
    let t = ember_runtime::Template::open(name).expect("the template");
    assert_eq!(
        t.info.env.get("EMBER_DF").map(String::as_str),
        Some("from-dockerfile")
    );
    let t_create = Instant::now();
    let sb = sandbox(name);
    assert_eq!(
        exec(
            &sb,
            "cat /srv/app/whoami /srv/app/last /srv/app/main.py; ls /srv/app/debug.log 2>/dev/null || echo ignored; \
             python3 -c 'import embertestpkg; print(embertestpkg.VALUE)'"
        ),
        format!("user\n{marker}\nprint('app')\nignored\nfrom-the-local-index\n")
    );
    eprintln!(
        "create -> first exec result: {:.0} ms",
        t_create.elapsed().as_secs_f64() * 1e3
    );
    let _ = sb.kill();
    // The edited build's template goes (a new one each run); the first one stays cached.
    // Removed by key, retried: its directory is busy while the killed sandbox's jail ends.
    let t_rm = Instant::now();
    loop {
        match ember_runtime::Template::remove(&t.info.key) {
            Ok(_) | Err(ember_runtime::TemplateError::NotBuilt { .. }) => break,
            Err(e) if t_rm.elapsed() > Duration::from_secs(60) => {
                panic!("removing the edited build {}: {e}", t.info.key)
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
    eprintln!("{test}: {:.1}s", t0.elapsed().as_secs_f64());
}

//! deploy/ checked offline by `scripts/validate-deploy.py` (docs/deploy.md): the real tree
//! passes, and broken copies of it are refused, each naming the file and the problem.
//!
//! Needs the validators' venv (`$EMBER_DEPLOY_PY`, set by `scripts/test.sh` from
//! `scripts/deploy-validators.sh`, or else the venv that script makes under `$EMBER_CACHE`)
//! and `systemd-analyze`; without them each test is skipped (a failure under `CI=true`).
//! ember's flags are checked against `$EMBER_BIN`, or else the `ember` built beside this test.

use std::path::{Path, PathBuf};
use std::process::Command;

/// How to run the validator here: its interpreter and, if there is one, an ember binary.
struct Validator {
    python: PathBuf,
    ember: Option<PathBuf>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository")
        .to_path_buf()
}

fn hash16(file: &Path) -> String {
    use sha2::Digest;
    let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let h = sha2::Sha256::digest(&data);
    h.iter().map(|b| format!("{b:02x}")).collect::<String>()[..16].to_string()
}

/// The validator, or None after a skip naming what is missing.
fn validator(test: &str) -> Option<Validator> {
    let python = match std::env::var_os("EMBER_DEPLOY_PY") {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "EMBER_DEPLOY_PY={} is no file", p.display());
            p
        }
        None => {
            let venv = ember_runtime::paths::cache_dir()
                .join("deploy-validators")
                .join(hash16(&repo().join("tests/deploy/requirements.txt")));
            if !venv.join(".ok").is_file() {
                ember_tests::skip(
                    test,
                    &format!(
                        "no deploy validators venv at {} (EMBER_DEPLOY_PY unset): run \
                         `bash scripts/deploy-validators.sh`",
                        venv.display()
                    ),
                );
                return None;
            }
            venv.join("bin/python")
        }
    };
    let has_verify = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_verify {
        ember_tests::skip(
            test,
            "no systemd-analyze (Debian's `systemd` package; scripts/test-prereqs.sh installs it)",
        );
        return None;
    }
    let ember = std::env::var_os("EMBER_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let exe = std::env::current_exe().ok()?;
            // target/<profile>/deps/<test> → target/<profile>/ember
            Some(exe.ancestors().nth(2)?.join("ember"))
        })
        .filter(|p| p.is_file());
    Some(Validator { python, ember })
}

impl Validator {
    /// Runs the validator on `deploy`: (its exit status was 0, what it printed).
    fn run(&self, deploy: &Path) -> (bool, String) {
        let mut cmd = Command::new(&self.python);
        cmd.arg(repo().join("scripts/validate-deploy.py"))
            .arg("--deploy")
            .arg(deploy);
        if let Some(ember) = &self.ember {
            cmd.arg("--ember").arg(ember);
        }
        let out = cmd.output().expect("run scripts/validate-deploy.py");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    /// Copies deploy/ into a temporary directory, replaces `from` by `to` in `file` (a path
    /// under deploy/), runs the validator on the copy and checks that it fails with a line
    /// `FAIL  deploy/<file>: ...<reason>...`.
    fn refuses(&self, file: &str, from: &str, to: &str, reason: &str) {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let deploy = tmp.path().join("deploy");
        copy_tree(&repo().join("deploy"), &deploy);
        let path = deploy.join(file);
        let text = std::fs::read_to_string(&path).expect("read the file to break");
        assert!(
            text.contains(from),
            "deploy/{file} no longer contains {from:?}"
        );
        std::fs::write(&path, text.replacen(from, to, 1)).expect("write the broken copy");
        let (ok, out) = self.run(&deploy);
        assert!(
            !ok,
            "the validator accepted deploy/{file} with {to:?}:\n{out}"
        );
        let prefix = format!("FAIL  deploy/{file}:");
        assert!(
            out.lines()
                .any(|l| l.starts_with(&prefix) && l.contains(reason)),
            "no `{prefix} ...{reason}...` line for {to:?}:\n{out}"
        );
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("dir entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

#[test]
fn the_deploy_tree_passes() {
    let Some(v) = validator("the_deploy_tree_passes") else {
        return;
    };
    if v.ember.is_none() {
        ember_tests::skip(
            "the_deploy_tree_passes (in part: ember's flags)",
            "no ember binary (EMBER_BIN, or `cargo build --bins`)",
        );
    }
    let (ok, out) = v.run(&repo().join("deploy"));
    assert!(ok, "scripts/validate-deploy.py refused deploy/:\n{out}");
    assert!(
        out.contains("validate-deploy: all "),
        "no closing line:\n{out}"
    );
    // Each engine was looked at.
    for what in [
        "DaemonSet/ember-node (base) valid",
        "overlays/demo",
        "ember-node.nomad.hcl",
        "ember-gateway.nomad.hcl",
        "ember-node.service: systemd-analyze verify: clean",
        "ember-gateway.service: systemd-analyze verify: clean",
    ] {
        assert!(out.contains(what), "nothing about {what:?}:\n{out}");
    }
    if v.ember.is_some() {
        assert!(
            out.contains("`ember node`: every flag and variable is ember's"),
            "ember's flags were not checked:\n{out}"
        );
    }
}

#[test]
fn a_daemonset_with_an_unknown_field_is_refused() {
    let Some(v) = validator("a_daemonset_with_an_unknown_field_is_refused") else {
        return;
    };
    v.refuses(
        "kubernetes/base/node-daemonset.yaml",
        "      hostNetwork: true\n",
        "      hostNetwork: true\n      hostNetwrok: true\n",
        "'hostNetwrok' was unexpected",
    );
}

#[test]
fn a_daemonset_with_a_wrong_type_is_refused() {
    let Some(v) = validator("a_daemonset_with_a_wrong_type_is_refused") else {
        return;
    };
    v.refuses(
        "kubernetes/base/node-daemonset.yaml",
        "terminationGracePeriodSeconds: 300",
        "terminationGracePeriodSeconds: \"300\"",
        "terminationGracePeriodSeconds: '300' is not of type 'integer'",
    );
}

#[test]
fn a_nomad_node_job_without_kill_timeout_is_refused() {
    let Some(v) = validator("a_nomad_node_job_without_kill_timeout_is_refused") else {
        return;
    };
    v.refuses(
        "nomad/ember-node.nomad.hcl",
        "kill_timeout = \"300s\"",
        "",
        "no kill_timeout",
    );
}

#[test]
fn a_unit_with_a_misspelled_directive_is_refused() {
    let Some(v) = validator("a_unit_with_a_misspelled_directive_is_refused") else {
        return;
    };
    v.refuses(
        "systemd/ember-node.service",
        "KillMode=process",
        "KillMod=process",
        "Unknown key 'KillMod'",
    );
}

#[test]
fn an_ember_flag_that_does_not_exist_is_refused() {
    const NAME: &str = "an_ember_flag_that_does_not_exist_is_refused";
    let Some(v) = validator(NAME) else {
        return;
    };
    if v.ember.is_none() {
        ember_tests::skip(NAME, "no ember binary (EMBER_BIN, or `cargo build --bins`)");
        return;
    }
    v.refuses(
        "kubernetes/base/gateway-deployment.yaml",
        "--node-token-file=",
        "--node-token-flie=",
        "unknown to ember: --node-token-flie",
    );
}

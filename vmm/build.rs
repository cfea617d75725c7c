//! Compiles the seccomp allow-lists in `seccomp/*.json` (seccompiler's JSON format, one file
//! per thread kind) into BPF programs at build time. Each file is compiled twice: as written
//! (mismatch action `kill_process`) and with the mismatch action replaced by `log`, for
//! `--seccomp log`. The programs are written to `$OUT_DIR/seccomp-<kind>-<mode>.bpf` as raw
//! `struct sock_filter` arrays (8 bytes each, little endian) and embedded by
//! `src/seccomp/mod.rs` with `include_bytes!`.

use std::path::{Path, PathBuf};

/// Thread kinds: each has `seccomp/<kind>.json` whose single top-level key is `<kind>`.
/// Keep in sync with `ThreadKind` in `src/seccomp/mod.rs`.
const KINDS: &[&str] = &["main", "vcpu", "prefetch", "log", "restore"];

/// Output modes and the mismatch action each is compiled with.
const MODES: &[(&str, &str)] = &[("kill", "kill_process"), ("log", "log")];

fn main() {
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let dir = manifest.join("seccomp");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", dir.display());

    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if arch != "x86_64" {
        // The ioctl numbers in the JSON files are x86-64 ones (KVM's state structs differ
        // between architectures), so refuse rather than build filters that kill the VMM.
        fail(&format!(
            "vmm/seccomp/*.json are written for x86_64; target architecture {arch:?} needs its own lists"
        ));
    }
    let target = seccompiler::TargetArch::x86_64;

    for kind in KINDS {
        let path = dir.join(format!("{kind}.json"));
        println!("cargo:rerun-if-changed={}", path.display());
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
        let json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| fail(&format!("{}: not JSON: {e}", path.display())));
        check_shape(&path, kind, &json);
        for (mode, action) in MODES {
            let mut variant = json.clone();
            variant[*kind]["mismatch_action"] = serde_json::Value::String((*action).to_string());
            let bytes = serde_json::to_vec(&variant).expect("serialising JSON cannot fail");
            let mut programs = seccompiler::compile_from_json(bytes.as_slice(), target)
                .unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
            let program = programs
                .remove(*kind)
                .unwrap_or_else(|| fail(&format!("{}: no filter named {kind:?}", path.display())));
            if program.len() > usize::from(u16::MAX) {
                fail(&format!(
                    "{}: BPF program too long ({} instructions)",
                    path.display(),
                    program.len()
                ));
            }
            let mut raw = Vec::with_capacity(program.len() * 8);
            for insn in &program {
                raw.extend_from_slice(&insn.code.to_le_bytes());
                raw.push(insn.jt);
                raw.push(insn.jf);
                raw.extend_from_slice(&insn.k.to_le_bytes());
            }
            let dest = out.join(format!("seccomp-{kind}-{mode}.bpf"));
            std::fs::write(&dest, raw)
                .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", dest.display())));
        }
    }
}

/// The file must hold exactly one filter, named after its thread kind, that kills on mismatch
/// and allows on match (an allow-list); the log variant is derived here, never written by hand.
fn check_shape(path: &Path, kind: &str, json: &serde_json::Value) {
    let Some(obj) = json.as_object() else {
        fail(&format!("{}: top level must be an object", path.display()));
    };
    if obj.len() != 1 || !obj.contains_key(kind) {
        fail(&format!(
            "{}: must hold exactly one filter, named {kind:?}",
            path.display()
        ));
    }
    let filter = &obj[kind];
    if filter["mismatch_action"] != "kill_process" {
        fail(&format!(
            "{}: mismatch_action must be \"kill_process\"",
            path.display()
        ));
    }
    if filter["match_action"] != "allow" {
        fail(&format!(
            "{}: match_action must be \"allow\"",
            path.display()
        ));
    }
    // seccompiler drops a syscall's unconditional rule when the same syscall also has rules
    // with arguments (only the conditional ones are kept): refuse such a mix so that a
    // narrower rule never silently replaces an "allow any" one.
    let mut plain = std::collections::BTreeSet::new();
    let mut with_args = std::collections::BTreeSet::new();
    for rule in filter["filter"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let name = rule["syscall"].as_str().unwrap_or_default().to_string();
        if rule.get("args").is_some() {
            with_args.insert(name);
        } else if !plain.insert(name.clone()) {
            fail(&format!("{}: {name} is listed twice", path.display()));
        }
    }
    if let Some(both) = plain.intersection(&with_args).next() {
        fail(&format!(
            "{}: {both} has both an unconditional rule and rules with args; keep one kind",
            path.display()
        ));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    panic!("seccomp filter build failed: {msg}");
}

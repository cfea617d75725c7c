//! `ember bench files`: file uploads and downloads through the native API, per size, with
//! the guest work each costs and the guest's own page-cache speed beside them.
//!
//! For each size (default 1, 8 and 64 MiB) and run: an upload of random bytes to a path in
//! the sandbox (`POST /v1/sandboxes/{id}/files`), then its download, checked byte for byte.
//! Around each, the VMM's KVM counters (`stats`: emulated instructions, exits, shadow-page
//! fills, guest faults and syscalls) give the guest work per MiB — the figure that carries
//! over to hardware KVM, where emulated ring 0 is not the cost. The reference is the same
//! size written to and read from the same filesystem by `dd` inside the guest (no vsock, no
//! agent; less the same `sh -c dd` moving nothing): what the guest kernel's page cache alone
//! costs, the floor any transfer that ends in a guest file pays. Results: a table and JSON lines
//! (`{"bench":"files","op":…,"size_mib":…,"mib_s":{…},"per_mib":{…}}`).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use ember_benches::stats::summarize;
use ember_runtime::Runtime;
use ember_server::client::Client;
use serde_json::{json, Value};

use crate::api::{catch_sigint, check_interrupt, Target};
use crate::fail;

/// `ember bench files`.
#[derive(Debug, Args)]
pub struct BenchFilesArgs {
    /// Template of the sandbox.
    #[arg(short, long, default_value = "default")]
    pub template: String,
    /// Sizes in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1u64, 8, 64])]
    pub sizes: Vec<u64>,
    /// Runs per size and direction.
    #[arg(long, default_value_t = 3)]
    pub n: usize,
    /// Where the file goes in the guest (its filesystem is the one `dd` measures).
    #[arg(long, default_value = "/tmp/ember-bench-file")]
    pub path: String,
    /// JSON lines only.
    #[arg(long)]
    pub json: bool,
}

/// The KVM counters reported per MiB.
pub(crate) const COUNTERS: &[&str] = &["insn_emulation", "exits", "pf_fixed", "pf_guest"];

pub(crate) type Counts = BTreeMap<String, u64>;

fn counts(rt: &Runtime, id: &str) -> Result<Counts, String> {
    let s = rt
        .vmm_stats(id)
        .map_err(|e| format!("the VMM's stats: {e}"))?;
    serde_json::from_value(s["kvm"]["vcpu"].clone())
        .map_err(|e| format!("the VMM's KVM counters: {e}"))
}

fn delta(a: &Counts, b: &Counts) -> Counts {
    COUNTERS
        .iter()
        .map(|k| {
            let d = b
                .get(*k)
                .unwrap_or(&0)
                .saturating_sub(*a.get(*k).unwrap_or(&0));
            (k.to_string(), d)
        })
        .collect()
}

/// Random-looking bytes (xorshift; compressible data would flatter nothing here, but the
/// bytes should not be all alike either).
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Runs `sh -c script` in the guest; its wall time through the API, ms.
fn exec(c: &Client, id: &str, script: &str) -> Result<f64, String> {
    let t0 = Instant::now();
    let last = c
        .stream(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({ "argv": ["sh", "-c", script] }),
            &mut |_| true,
        )
        .map_err(|e| format!("exec {script:?}: {e}"))?;
    match last {
        Some(v) if v["type"] == "end" && v["exit"]["code"] == 0 => {
            Ok(t0.elapsed().as_secs_f64() * 1e3)
        }
        other => Err(format!(
            "exec {script:?}: last line {}",
            other.unwrap_or(Value::Null)
        )),
    }
}

/// One measured operation: its times (ms) and guest counters, per run.
#[derive(Default)]
pub(crate) struct Op {
    pub(crate) ms: Vec<f64>,
    pub(crate) counts: Vec<Counts>,
}

impl Op {
    fn line(&self, op: &str, size_mib: u64, reference: Option<f64>) -> Value {
        let mib = size_mib as f64;
        let rates: Vec<f64> = self.ms.iter().map(|ms| mib / (ms / 1e3)).collect();
        let s = summarize(&rates);
        let per_mib: BTreeMap<&str, f64> = COUNTERS
            .iter()
            .map(|k| {
                let mut v: Vec<f64> = self
                    .counts
                    .iter()
                    .map(|c| *c.get(*k).unwrap_or(&0) as f64 / mib)
                    .collect();
                v.sort_by(f64::total_cmp);
                (*k, v.get(v.len() / 2).copied().unwrap_or(0.0))
            })
            .collect();
        let median_ms = summarize(&self.ms).map(|s| s.median_ms);
        json!({
            "bench": "files", "op": op, "size_mib": size_mib, "n": self.ms.len(),
            "ms": median_ms,
            "mib_s": s.map(|s| json!({"median": s.median_ms, "min": s.min_ms, "max": s.max_ms})),
            "per_mib": per_mib,
            "vs_guest_dd": reference.and_then(|r| median_ms.map(|m| m / r)),
        })
    }
}

fn run(a: &BenchFilesArgs) -> Result<Vec<Value>, String> {
    crate::open_or_build(&a.template, a.json).map_err(|e| e.to_string())?;
    let (target, _) = Target::start_local(Default::default()).map_err(|e| e.to_string())?;
    let quiet = a.json;
    let runs = measure(&target, &a.template, &a.sizes, a.n, &a.path, &|msg| {
        if !quiet {
            eprintln!("{msg}");
        }
    })?;
    Ok(runs.iter().flat_map(SizeRuns::lines).collect())
}

/// One size's runs: the upload, the download and the guest's own `dd` write and read.
#[derive(Default)]
pub(crate) struct SizeRuns {
    pub(crate) size_mib: u64,
    pub(crate) upload: Op,
    pub(crate) download: Op,
    pub(crate) dd_write: Op,
    pub(crate) dd_read: Op,
}

impl SizeRuns {
    /// The four operations with their labels.
    pub(crate) fn ops(&self) -> [(&'static str, &Op); 4] {
        [
            ("upload", &self.upload),
            ("download", &self.download),
            ("guest dd write", &self.dd_write),
            ("guest dd read", &self.dd_read),
        ]
    }

    /// The JSON lines of `ember bench files`.
    fn lines(&self) -> Vec<Value> {
        let (rw, rr) = (
            summarize(&self.dd_write.ms).map(|s| s.median_ms),
            summarize(&self.dd_read.ms).map(|s| s.median_ms),
        );
        vec![
            self.upload.line("upload", self.size_mib, rw),
            self.download.line("download", self.size_mib, rr),
            self.dd_write.line("guest dd write", self.size_mib, None),
            self.dd_read.line("guest dd read", self.size_mib, None),
        ]
    }
}

/// Uploads and downloads `sizes` (MiB), `n` runs each, through `target` (an in-process
/// server: its runtime gives the KVM counters) into a new sandbox of `template`, beside the
/// guest's own `dd`; `progress` hears of each run. The sandbox is killed at the end.
pub(crate) fn measure(
    target: &Target,
    template: &str,
    sizes: &[u64],
    n: usize,
    path: &str,
    progress: &dyn Fn(String),
) -> Result<Vec<SizeRuns>, String> {
    let rt = target
        .local
        .as_ref()
        .and_then(|l| l.rt.clone())
        .ok_or("no runtime")?;
    let c = &target.client;
    let id = target.create(template).map_err(|e| e.to_string())?.id;
    let r = measure_in(&rt, c, &id, sizes, n, path, progress);
    let killed = target.kill(&id).map_err(|e| e.to_string());
    let runs = r?;
    killed?;
    Ok(runs)
}

fn measure_in(
    rt: &Runtime,
    c: &Client,
    id: &str,
    sizes: &[u64],
    n: usize,
    path: &str,
    progress: &dyn Fn(String),
) -> Result<Vec<SizeRuns>, String> {
    let mut out = Vec::new();
    for &size in sizes {
        let bytes = usize::try_from(size << 20).map_err(|_| format!("{size} MiB: too large"))?;
        let mut s = SizeRuns {
            size_mib: size,
            ..SizeRuns::default()
        };
        for run in 0..n {
            check_interrupt().map_err(|e| e.to_string())?;
            progress(format!("files: {size} MiB, run {} of {n}", run + 1));
            let body = data(bytes, 0x9e37_79b9 ^ ((size << 8) + run as u64));
            let c0 = counts(rt, id)?;
            let t0 = Instant::now();
            let w = c
                .upload(id, path, &body[..], Some(bytes as u64))
                .map_err(|e| format!("upload {size} MiB: {e}"))?;
            s.upload.ms.push(t0.elapsed().as_secs_f64() * 1e3);
            let c1 = counts(rt, id)?;
            s.upload.counts.push(delta(&c0, &c1));
            if w.bytes != bytes as u64 {
                return Err(format!("upload wrote {} of {bytes} bytes", w.bytes));
            }
            let mut back = Vec::with_capacity(bytes);
            let t0 = Instant::now();
            let got = c
                .download(id, path, &mut back)
                .map_err(|e| format!("download {size} MiB: {e}"))?;
            s.download.ms.push(t0.elapsed().as_secs_f64() * 1e3);
            s.download.counts.push(delta(&c1, &counts(rt, id)?));
            if got != bytes as u64 || back != body {
                return Err(format!(
                    "download of {size} MiB gave {got} bytes that differ from the upload"
                ));
            }
            // The guest's own page cache: the same size written and read back by dd, less
            // what starting `sh` and `dd` costs (the same commands moving nothing).
            let c0 = counts(rt, id)?;
            let base_ms = exec(
                c,
                id,
                &format!("dd if=/dev/zero of={path}.dd bs=1M count=0 2>/dev/null"),
            )?;
            let c1 = counts(rt, id)?;
            let base = delta(&c0, &c1);
            let less = |ms: f64, d: Counts| -> (f64, Counts) {
                let d = d
                    .into_iter()
                    .map(|(k, v)| {
                        let b = *base.get(&k).unwrap_or(&0);
                        (k, v.saturating_sub(b))
                    })
                    .collect();
                ((ms - base_ms).max(1.0), d)
            };
            let c0 = counts(rt, id)?;
            let ms = exec(
                c,
                id,
                &format!("dd if=/dev/zero of={path}.dd bs=1M count={size} 2>/dev/null"),
            )?;
            let c1 = counts(rt, id)?;
            let (ms, d) = less(ms, delta(&c0, &c1));
            s.dd_write.ms.push(ms);
            s.dd_write.counts.push(d);
            let ms = exec(
                c,
                id,
                &format!("dd if={path}.dd of=/dev/null bs=1M 2>/dev/null"),
            )?;
            let (ms, d) = less(ms, delta(&c1, &counts(rt, id)?));
            s.dd_read.ms.push(ms);
            s.dd_read.counts.push(d);
            exec(c, id, &format!("rm -f {path}.dd"))?;
        }
        out.push(s);
    }
    Ok(out)
}

fn print_table(lines: &[Value]) {
    eprintln!(
        "{:<16} {:>6} {:>10} {:>8} {:>14} {:>10} {:>9} {:>9}",
        "op", "MiB", "ms", "MiB/s", "emul insn/MiB", "exits/MiB", "pf/MiB", "vs dd"
    );
    for l in lines {
        let f = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.1}"));
        eprintln!(
            "{:<16} {:>6} {:>10} {:>8} {:>14} {:>10} {:>9} {:>9}",
            l["op"].as_str().unwrap_or("?"),
            l["size_mib"],
            f(&l["ms"]),
            f(&l["mib_s"]["median"]),
            f(&l["per_mib"]["insn_emulation"]),
            f(&l["per_mib"]["exits"]),
            f(&l["per_mib"]["pf_fixed"]),
            l["vs_guest_dd"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.2}×")),
        );
    }
}

/// `ember bench files`.
pub fn main(a: BenchFilesArgs) -> ExitCode {
    catch_sigint();
    if a.sizes.is_empty() || a.sizes.contains(&0) || a.n == 0 {
        return fail("--sizes needs sizes of at least 1 MiB and --n at least 1");
    }
    if !a.path.starts_with('/') || a.path.contains(['\'', '"', ' ', ';', '$', '`']) {
        return fail(format!(
            "--path {:?}: an absolute guest path without quotes, spaces or shell characters",
            a.path
        ));
    }
    match run(&a) {
        Ok(lines) => {
            for l in &lines {
                println!("{l}");
            }
            if !a.json {
                print_table(&lines);
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_deterministic_and_varied() {
        let a = data(4096, 7);
        assert_eq!(a, data(4096, 7));
        assert_ne!(a, data(4096, 8));
        assert!(a.iter().filter(|b| **b == a[0]).count() < 64);
    }

    #[test]
    fn a_line_gives_rates_counts_per_mib_and_the_ratio() {
        let op = Op {
            ms: vec![1000.0, 2000.0, 4000.0],
            counts: vec![
                [("insn_emulation".to_string(), 800u64)].into(),
                [("insn_emulation".to_string(), 1600u64)].into(),
                [("insn_emulation".to_string(), 3200u64)].into(),
            ],
        };
        let l = op.line("upload", 8, Some(1000.0));
        assert_eq!(l["mib_s"]["median"], 4.0);
        assert_eq!(l["per_mib"]["insn_emulation"], 200.0);
        assert_eq!(l["vs_guest_dd"], 2.0);
    }
}

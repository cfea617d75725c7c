//! The harness's record: every sample of a run as JSON lines, written as they are measured
//! (an interrupted run keeps what it measured), and read back for reports and comparisons.
//!
//! One object per line, tagged by `type`:
//! - `env`: where the run happened ([`Environment`]), first;
//! - `sample`: one measured value ([`Sample`]);
//! - `skip`: a scenario or peer that did not run, and why ([`Skip`]);
//! - `note`: anything else worth keeping beside the figures.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// One measured value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Scenario (`boot`, `restore`, `sandbox`, `rtt`, `parallel`, `density`, `pause`).
    pub scenario: String,
    /// System measured (`ember`, `firecracker`, `qemu`).
    pub system: String,
    /// What was measured, with its qualifier (template, size, clients...).
    pub measure: String,
    /// Unit of `value` (`ms`, `MiB`, `%`, `creates/s`, `bytes`).
    pub unit: String,
    /// Run number within (scenario, system, measure), warm-ups excluded.
    pub run: usize,
    /// The value.
    pub value: f64,
    /// An independent variable when the measure has one (sandboxes running, clients).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x: Option<f64>,
}

/// A scenario or peer that did not run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skip {
    /// Scenario.
    pub scenario: String,
    /// System (or `*` for the whole scenario).
    pub system: String,
    /// Why.
    pub reason: String,
}

/// Where the figures come from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    /// Host kernel release (`uname -r`).
    pub host_kernel: String,
    /// The KVM behind /dev/kvm (`kvm_pvm`, `kvm_intel`, `kvm_amd`...).
    pub kvm: String,
    /// Host CPU model name.
    pub cpu_model: String,
    /// Online host CPUs.
    pub host_cpus: usize,
    /// The guest CPU profile.
    pub cpu_profile: String,
    /// Guest kernel cache key (its directory name) and path.
    pub guest_kernel: String,
    /// Guest rootfs cache key and path.
    pub guest_rootfs: String,
    /// ember's version.
    pub ember_version: String,
    /// The git revision of the source tree the binary was built in, read when the run starts
    /// (`EMBER_GIT_REV` at build time wins).
    pub git_revision: String,
    /// Peer versions (`firecracker`, `qemu`), when run.
    pub peers: Vec<(String, String)>,
    /// The command line that produced the run.
    pub command: String,
    /// When it started (RFC 3339, UTC).
    pub started: String,
}

/// One line of the record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line {
    /// The environment.
    Env(Environment),
    /// A sample.
    Sample(Sample),
    /// A skip.
    Skip(Skip),
    /// A note.
    Note {
        /// Scenario it belongs to.
        scenario: String,
        /// Text.
        text: String,
    },
}

/// Errors of the record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a record line.
    #[error("{}:{line}: not a bench record line: {detail}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why.
        detail: String,
    },
}

/// Appends lines to a JSON-lines file, flushing each (thread-safe), and keeps them in memory.
#[derive(Debug)]
pub struct Recorder {
    path: PathBuf,
    inner: Mutex<(File, Vec<Line>)>,
}

impl Recorder {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path) -> Result<Self, RecordError> {
        let file = File::create(path).map_err(|source| RecordError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            inner: Mutex::new((file, Vec::new())),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one line.
    pub fn push(&self, line: Line) -> Result<(), RecordError> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let text = serde_json::to_string(&line).unwrap_or_default();
        writeln!(g.0, "{text}")
            .and_then(|_| g.0.flush())
            .map_err(|source| RecordError::Io {
                path: self.path.clone(),
                source,
            })?;
        g.1.push(line);
        Ok(())
    }

    /// Writes one sample.
    pub fn sample(&self, s: Sample) -> Result<(), RecordError> {
        self.push(Line::Sample(s))
    }

    /// Everything written so far.
    pub fn lines(&self) -> Vec<Line> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }
}

/// Reads a record file.
pub fn read(path: &Path) -> Result<Vec<Line>, RecordError> {
    let f = File::open(path).map_err(|source| RecordError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|source| RecordError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(serde_json::from_str(&line).map_err(|e| RecordError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            detail: e.to_string(),
        })?);
    }
    Ok(out)
}

/// The samples of `lines`.
pub fn samples(lines: &[Line]) -> Vec<&Sample> {
    lines
        .iter()
        .filter_map(|l| match l {
            Line::Sample(s) => Some(s),
            _ => None,
        })
        .collect()
}

/// A key identifying one distribution: (scenario, measure, system).
pub type Key = (String, String, String);

/// Samples grouped by [`Key`], in first-seen order, with their unit.
pub fn groups(lines: &[Line]) -> Vec<(Key, String, Vec<f64>)> {
    let mut out: Vec<(Key, String, Vec<f64>)> = Vec::new();
    for s in samples(lines) {
        let key = (s.scenario.clone(), s.measure.clone(), s.system.clone());
        match out.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.2.push(s.value),
            None => out.push((key, s.unit.clone(), vec![s.value])),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(system: &str, value: f64) -> Sample {
        Sample {
            scenario: "boot".into(),
            system: system.into(),
            measure: "spawn → marker".into(),
            unit: "ms".into(),
            run: 0,
            value,
            x: None,
        }
    }

    #[test]
    fn lines_round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let r = Recorder::create(&p).unwrap();
        r.push(Line::Env(Environment {
            kvm: "kvm_pvm".into(),
            ..Default::default()
        }))
        .unwrap();
        r.sample(sample("ember", 1.5)).unwrap();
        r.sample(sample("qemu", 3.0)).unwrap();
        r.sample(sample("ember", 2.5)).unwrap();
        r.push(Line::Skip(Skip {
            scenario: "boot".into(),
            system: "firecracker".into(),
            reason: "no --firecracker".into(),
        }))
        .unwrap();
        let back = read(&p).unwrap();
        assert_eq!(back, r.lines());
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text
            .lines()
            .nth(1)
            .unwrap()
            .starts_with(r#"{"type":"sample""#));
        let g = groups(&back);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].2, vec![1.5, 2.5]);
        assert_eq!(g[1].0 .2, "qemu");
    }

    #[test]
    fn a_bad_line_names_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        std::fs::write(
            &p,
            "{\"type\":\"note\",\"scenario\":\"x\",\"text\":\"y\"}\nnope\n",
        )
        .unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains(":2:"), "{e}");
    }
}

//! Machine-readable events from the VMM: one JSON object per line, written to a report file
//! (`--report PATH`) as they happen. `ember vm boot --json` and the benchmarks read these
//! instead of scraping the console.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Nanoseconds on `CLOCK_MONOTONIC`, comparable across processes on this host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// When the VMM process started doing work, in both clocks.
#[derive(Debug, Clone, Copy)]
pub struct StartTime {
    /// Process-local instant.
    pub instant: Instant,
    /// CLOCK_MONOTONIC at the same moment.
    pub mono_ns: u64,
}

impl StartTime {
    /// Now.
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            mono_ns: monotonic_ns(),
        }
    }

    /// CLOCK_MONOTONIC of a later instant.
    pub fn mono_of(&self, t: Instant) -> u64 {
        self.mono_ns + t.saturating_duration_since(self.instant).as_nanos() as u64
    }
}

/// A shared, cloneable writer of JSON-lines events (a no-op without a file).
#[derive(Debug, Clone, Default)]
pub struct Reporter {
    file: Option<Arc<Mutex<ReportFile>>>,
}

/// Most bytes a report file may hold: events a guest can cause (boot-marker writes) must not
/// fill the host's disk. Past it, one `report_truncated` line is written and later events are
/// counted, not written.
pub const REPORT_MAX_BYTES: u64 = 4 << 20;

#[derive(Debug)]
struct ReportFile {
    file: File,
    written: u64,
    dropped: u64,
}

impl Reporter {
    /// Reports to `path` (created or truncated).
    pub fn to_file(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            file: Some(Arc::new(Mutex::new(ReportFile {
                file: File::create(path)?,
                written: 0,
                dropped: 0,
            }))),
        })
    }

    /// Writes one event; `kind` goes into the `event` field.
    pub fn event(&self, kind: &str, mut body: serde_json::Value) {
        if let Some(obj) = body.as_object_mut() {
            obj.insert("event".into(), kind.into());
        }
        if let Some(f) = &self.file {
            // One write per line, so concurrent writers never interleave partial lines.
            let mut line = body.to_string();
            line.push('\n');
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            write_capped(&mut f, &line, REPORT_MAX_BYTES);
        }
    }
}

fn write_capped(f: &mut ReportFile, line: &str, limit: u64) {
    if f.dropped > 0 || f.written + line.len() as u64 > limit {
        if f.dropped == 0 {
            let note = format!("{{\"event\":\"report_truncated\",\"limit_bytes\":{limit}}}\n");
            let _ = f.file.write_all(note.as_bytes());
        }
        f.dropped += 1;
        return;
    }
    if f.file.write_all(line.as_bytes()).is_ok() {
        f.written += line.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_stops_at_its_cap_with_one_truncation_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let mut f = ReportFile {
            file: File::create(&p).unwrap(),
            written: 0,
            dropped: 0,
        };
        for _ in 0..1000 {
            write_capped(&mut f, "{\"event\":\"boot_marker\"}\n", 100);
        }
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.len() < 200, "{}", text.len());
        assert_eq!(text.matches("report_truncated").count(), 1);
        assert_eq!(f.dropped, 1000 - 4);
    }

    #[test]
    fn writes_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let r = Reporter::to_file(&p).unwrap();
        r.event("boot_marker", serde_json::json!({"value": 1}));
        r.clone().event("exit", serde_json::json!({"code": 0}));
        let s = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<serde_json::Value> = s
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["event"], "boot_marker");
        assert_eq!(lines[1]["code"], 0);
        Reporter::default().event("ignored", serde_json::json!({}));
    }

    #[test]
    fn monotonic_advances() {
        let s = StartTime::now();
        let later = Instant::now();
        assert!(s.mono_of(later) >= s.mono_ns);
        assert!(monotonic_ns() >= s.mono_ns);
    }
}

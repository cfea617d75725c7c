//! Printing `run_code` events for people: text to the terminal, rich output (images, HTML,
//! SVG...) to files whose paths are printed.

use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine;
use ember_agent::protocol::{EndStatus, EventKind};
use serde_json::{Map, Value};

/// Renders the events of the cells of one `ember run` (or one `ember code`).
#[derive(Debug)]
pub struct Renderer {
    /// Where rich output is saved; None: it is only described (`[image/png 1234 bytes]`).
    out_dir: Option<PathBuf>,
    json: bool,
    cell: usize,
    saved: usize,
    /// Files written so far.
    pub files: Vec<PathBuf>,
}

/// File extension for a MIME type saved to disk.
fn extension(mime: &str) -> Option<&'static str> {
    Some(match mime {
        "image/png" => "png",
        "image/jpeg" => "jpg",
        "image/svg+xml" => "svg",
        "text/html" => "html",
        "text/markdown" => "md",
        "text/latex" => "tex",
        "application/json" => "json",
        _ => return None,
    })
}

/// The size of a MIME bundle value as its bytes (base64 images decoded).
fn value_bytes(mime: &str, value: &Value) -> usize {
    match (mime.starts_with("image/") && mime != "image/svg+xml", value) {
        (true, Value::String(b64)) => {
            let t = b64.trim();
            let pad = t.bytes().rev().take_while(|c| *c == b'=').count();
            (t.len() / 4 * 3).saturating_sub(pad)
        }
        (_, Value::String(s)) => s.len(),
        (_, v) => serde_json::to_vec(v).map(|b| b.len()).unwrap_or(0),
    }
}

impl Renderer {
    /// Rich output goes to `out_dir`; `json` prints raw events as JSON lines instead.
    pub fn new(out_dir: &Path, json: bool) -> Self {
        Self {
            out_dir: Some(out_dir.to_path_buf()),
            json,
            cell: 0,
            saved: 0,
            files: Vec::new(),
        }
    }

    /// Rich output is described by type and size, not saved.
    pub fn describing(json: bool) -> Self {
        Self {
            out_dir: None,
            json,
            cell: 0,
            saved: 0,
            files: Vec::new(),
        }
    }

    /// The next cell starts.
    pub fn start_cell(&mut self, n: usize) {
        self.cell = n;
    }

    fn save(&mut self, mime: &str, value: &Value) -> std::io::Result<Option<PathBuf>> {
        let (Some(ext), Some(out_dir)) = (extension(mime), self.out_dir.clone()) else {
            return Ok(None);
        };
        let bytes = match (mime, value) {
            ("image/png" | "image/jpeg", Value::String(b64)) => {
                match base64::engine::general_purpose::STANDARD.decode(b64.trim()) {
                    Ok(b) => b,
                    Err(_) => return Ok(None),
                }
            }
            (_, Value::String(s)) => s.clone().into_bytes(),
            (_, v) => serde_json::to_vec_pretty(v).unwrap_or_default(),
        };
        std::fs::create_dir_all(&out_dir)?;
        self.saved += 1;
        let path = out_dir.join(format!("cell{}-{}.{ext}", self.cell, self.saved));
        std::fs::write(&path, bytes)?;
        self.files.push(path.clone());
        Ok(Some(path))
    }

    fn bundle(&mut self, label: &str, data: &Map<String, Value>) {
        let mut saved = Vec::new();
        for (mime, value) in data {
            if mime == "text/plain" {
                continue;
            }
            if self.out_dir.is_none() {
                saved.push(format!("{mime} {} bytes", value_bytes(mime, value)));
                continue;
            }
            match self.save(mime, value) {
                Ok(Some(p)) => saved.push(format!("{mime} → {}", p.display())),
                Ok(None) => saved.push(format!("{mime} (not saved)")),
                Err(e) => eprintln!("ember: cannot save {mime}: {e}"),
            }
        }
        let text = data.get("text/plain").and_then(Value::as_str);
        let mut out = std::io::stdout().lock();
        match text {
            Some(t) if label.is_empty() => {
                let _ = writeln!(out, "{t}");
            }
            Some(t) => {
                let _ = writeln!(out, "{label}{t}");
            }
            None => {}
        }
        for s in saved {
            let _ = writeln!(out, "[{s}]");
        }
    }

    /// Prints one event.
    pub fn event(&mut self, ev: &EventKind) {
        if self.json {
            let line = serde_json::json!({"cell": self.cell, "event": ev});
            println!("{line}");
            return;
        }
        match ev {
            EventKind::Stdout { data } => {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(data);
                let _ = o.flush();
            }
            EventKind::Stderr { data } => {
                let _ = std::io::stderr().write_all(data);
            }
            EventKind::Result(r) => {
                let label = match r.execution_count {
                    Some(n) => format!("Out[{n}]: "),
                    None => String::new(),
                };
                self.bundle(&label, &r.data)
            }
            EventKind::Display(d) => self.bundle("", &d.data),
            EventKind::Exception(x) => {
                use std::io::IsTerminal;
                let mut e = std::io::stderr().lock();
                // IPython's tracebacks carry their own colours; the plain ones get red.
                let red = e.is_terminal() && !x.traceback.iter().any(|l| l.contains('\x1b'));
                if red {
                    let _ = write!(e, "\x1b[31m");
                }
                for line in &x.traceback {
                    let _ = writeln!(e, "{line}");
                }
                if x.traceback.is_empty() {
                    let _ = writeln!(e, "{}: {}", x.name, x.value);
                }
                if red {
                    let _ = write!(e, "\x1b[0m");
                }
            }
            EventKind::Truncated { .. } => {
                eprintln!("ember: [output truncated at the cap; the rest was dropped]")
            }
            EventKind::ContextRestarted { reason } => {
                eprintln!("ember: [the context was restarted: {reason}]")
            }
            EventKind::End { status, .. } => match status {
                EndStatus::Ok | EndStatus::Error => {}
                EndStatus::TimedOut => eprintln!("ember: [timed out; the context was kept]"),
                EndStatus::Interrupted => eprintln!("ember: [interrupted]"),
                EndStatus::ContextDied => eprintln!("ember: [the context's process died]"),
                EndStatus::Unknown => eprintln!("ember: [ended with an unknown status]"),
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn described_images_give_their_decoded_size() {
        let png = base64::engine::general_purpose::STANDARD.encode([7u8; 12345]);
        assert_eq!(value_bytes("image/png", &Value::String(png)), 12345);
        assert_eq!(value_bytes("text/html", &Value::String("<b>".into())), 3);
        let mut r = Renderer::describing(false);
        let mut data = Map::new();
        data.insert("image/png".into(), Value::String("AAAA".into()));
        r.bundle("", &data);
        assert!(r.files.is_empty());
    }

    #[test]
    fn png_bundles_are_saved_decoded() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Renderer::new(dir.path(), false);
        r.start_cell(3);
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\nrest");
        let mut data = Map::new();
        data.insert("image/png".into(), Value::String(png));
        data.insert("text/plain".into(), Value::String("<Figure>".into()));
        r.bundle("", &data);
        assert_eq!(r.files.len(), 1);
        let bytes = std::fs::read(&r.files[0]).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"));
        assert!(r.files[0].to_string_lossy().ends_with("cell3-1.png"));
    }
}

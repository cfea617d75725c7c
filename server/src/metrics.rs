//! `/metrics`: the runtime's counters and the server's request counts in the Prometheus text
//! exposition format (version 0.0.4).

use std::collections::BTreeMap;
use std::fmt::Write;

use ember_runtime::{Histogram, Metrics};

/// Requests answered, by matched route and status.
pub type HttpCounts = BTreeMap<(String, u16), u64>;

/// A label value with `\`, `"` and newlines escaped.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One histogram's series; `labels` is `k="v",` pairs (with the trailing comma) or empty.
fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let mut cumulative = 0u64;
    for (i, bound) in h.bounds.iter().enumerate() {
        cumulative += h.counts.get(i).copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", h.count);
    let labels = labels.trim_end_matches(',');
    let braces = if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    };
    let _ = writeln!(out, "{name}_sum{braces} {}", h.sum);
    let _ = writeln!(out, "{name}_count{braces} {}", h.count);
}

/// The exposition text.
pub fn render(m: &Metrics, http: &HttpCounts) -> String {
    let mut out = String::new();
    header(&mut out, "ember_sandboxes", "gauge", "Sandboxes by state.");
    for (state, n) in &m.by_state {
        let _ = writeln!(out, "ember_sandboxes{{state=\"{}\"}} {n}", esc(state));
    }
    header(
        &mut out,
        "ember_creates_total",
        "counter",
        "Sandbox creates that succeeded.",
    );
    let _ = writeln!(out, "ember_creates_total {}", m.creates);
    header(
        &mut out,
        "ember_create_failures_total",
        "counter",
        "Sandbox creates that failed.",
    );
    let _ = writeln!(out, "ember_create_failures_total {}", m.create_failures);
    header(
        &mut out,
        "ember_vmm_failures_total",
        "counter",
        "VMMs that died unexpectedly.",
    );
    let _ = writeln!(out, "ember_vmm_failures_total {}", m.vmm_failures);
    header(
        &mut out,
        "ember_create_duration_ms",
        "histogram",
        "Time to create a sandbox (spawn to guest synced), milliseconds.",
    );
    histogram(&mut out, "ember_create_duration_ms", "", &m.create_ms);
    header(
        &mut out,
        "ember_call_duration_ms",
        "histogram",
        "Duration of runtime calls by call, milliseconds.",
    );
    for (call, h) in &m.call_ms {
        let labels = format!("call=\"{}\",", esc(call));
        histogram(&mut out, "ember_call_duration_ms", &labels, h);
    }
    header(
        &mut out,
        "ember_committed_memory_mib",
        "gauge",
        "Guest memory of the sandboxes that have a VMM, MiB.",
    );
    let _ = writeln!(out, "ember_committed_memory_mib {}", m.committed_memory_mib);
    header(
        &mut out,
        "ember_http_requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
    );
    for ((route, status), n) in http {
        let _ = writeln!(
            out,
            "ember_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
            esc(route)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let mut m = Metrics::default();
        m.create_ms.observe(0.5);
        m.create_ms.observe(3.0);
        m.create_ms.observe(1e9);
        let mut h = Histogram::default();
        h.observe(7.0);
        m.call_ms.insert("run\"code".into(), h);
        m.by_state.insert("running".into(), 2);
        let mut http = HttpCounts::new();
        http.insert(("/v1/sandboxes".into(), 200), 4);
        let text = render(&m, &http);
        assert!(text.contains("ember_create_duration_ms_bucket{le=\"1\"} 1\n"));
        assert!(text.contains("ember_create_duration_ms_bucket{le=\"2.5\"} 1\n"));
        assert!(text.contains("ember_create_duration_ms_bucket{le=\"5\"} 2\n"));
        assert!(text.contains("ember_create_duration_ms_bucket{le=\"30000\"} 2\n"));
        assert!(text.contains("ember_create_duration_ms_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("ember_create_duration_ms_count 3\n"));
        assert!(text.contains("ember_call_duration_ms_bucket{call=\"run\\\"code\",le=\"10\"} 1\n"));
        assert!(text.contains("ember_call_duration_ms_sum{call=\"run\\\"code\"} 7\n"));
        assert!(text.contains("ember_sandboxes{state=\"running\"} 2\n"));
        assert!(
            text.contains("ember_http_requests_total{route=\"/v1/sandboxes\",status=\"200\"} 4\n")
        );
        // Every sample line is `name{labels} value` or `name value`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = l.rsplit_once(' ').unwrap();
            assert!(value.parse::<f64>().is_ok(), "{l}");
        }
    }
}

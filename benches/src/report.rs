//! Reports of a record: a human table per scenario (median, p95, min, max, N and the ratio
//! ember/peer of the medians for every peer measured beside ember), and one self-contained
//! HTML page with the tables, the CDF plots embedded and the environment.

use std::fmt::Write as _;
use std::path::Path;

use base64::Engine;

use crate::plot::{self, Cdf, Plotted};
use crate::record::{groups, Environment, Line};
use crate::stats::{summarize, Summary};

/// Scenarios in report order.
pub const SCENARIOS: &[&str] = &[
    "boot", "restore", "sandbox", "ready", "rtt", "files", "parallel", "density", "pause",
];

/// One row of a scenario's table.
#[derive(Debug, Clone)]
pub struct Row {
    /// Measure.
    pub measure: String,
    /// System.
    pub system: String,
    /// Unit.
    pub unit: String,
    /// Statistics.
    pub summary: Summary,
    /// ember's median over this system's median for the same measure (peers only).
    pub ember_over_peer: Option<f64>,
}

/// The rows of `scenario`, ember first within each measure.
pub fn rows(lines: &[Line], scenario: &str) -> Vec<Row> {
    let g = groups(lines);
    let mut out = Vec::new();
    let mut measures: Vec<&str> = Vec::new();
    for ((sc, m, _), _, _) in &g {
        if sc == scenario && !measures.contains(&m.as_str()) {
            measures.push(m);
        }
    }
    for m in measures {
        let mut in_measure: Vec<_> = g
            .iter()
            .filter(|((sc, mm, _), _, _)| sc == scenario && mm == m)
            .collect();
        in_measure.sort_by_key(|((_, _, sys), _, _)| sys != "ember");
        let ember = in_measure
            .iter()
            .find(|((_, _, sys), _, _)| sys == "ember")
            .and_then(|(_, _, v)| summarize(v));
        for ((_, _, sys), unit, v) in in_measure {
            let Some(s) = summarize(v) else { continue };
            let ratio = match (sys.as_str(), ember) {
                ("ember", _) | (_, None) => None,
                (_, Some(e)) if s.median_ms != 0.0 => Some(e.median_ms / s.median_ms),
                _ => None,
            };
            out.push(Row {
                measure: m.to_string(),
                system: sys.clone(),
                unit: unit.clone(),
                summary: s,
                ember_over_peer: ratio,
            });
        }
    }
    out
}

/// Skip lines of `scenario`.
pub fn skips(lines: &[Line], scenario: &str) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| match l {
            Line::Skip(s) if s.scenario == scenario => Some(if s.system == "*" {
                format!("skipped: {}", s.reason)
            } else {
                format!("{} skipped: {}", s.system, s.reason)
            }),
            Line::Note { scenario: sc, text } if sc == scenario => Some(format!("note: {text}")),
            _ => None,
        })
        .collect()
}

fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn ratio_text(r: &Row) -> String {
    match r.ember_over_peer {
        Some(x) => format!("{x:.2}×"),
        None if r.system == "ember" => "(base)".into(),
        None => "-".into(),
    }
}

/// The human table of one scenario (empty when it has neither rows nor skips).
pub fn table(lines: &[Line], scenario: &str) -> String {
    let rows = rows(lines, scenario);
    let skips = skips(lines, scenario);
    if rows.is_empty() && skips.is_empty() {
        return String::new();
    }
    let mut s = format!("== {scenario} ==\n");
    if !rows.is_empty() {
        let w = rows
            .iter()
            .map(|r| r.measure.chars().count())
            .max()
            .unwrap_or(8)
            .max(8);
        let _ = writeln!(
            s,
            "{:<w$} {:<11} {:>4} {:>10} {:>10} {:>10} {:>10} {:<9} {:>10}",
            "measure", "system", "N", "median", "p95", "min", "max", "unit", "ember/peer"
        );
        for r in &rows {
            let _ = writeln!(
                s,
                "{:<w$} {:<11} {:>4} {:>10} {:>10} {:>10} {:>10} {:<9} {:>10}",
                r.measure,
                r.system,
                r.summary.n,
                num(r.summary.median_ms),
                num(r.summary.p95_ms),
                num(r.summary.min_ms),
                num(r.summary.max_ms),
                r.unit,
                ratio_text(r)
            );
        }
        if rows.iter().all(|r| r.system == "ember") {
            s.push_str("(ember only: no peer runs this scenario)\n");
        }
    }
    for k in skips {
        s.push_str(&k);
        s.push('\n');
    }
    s
}

/// Every scenario's table.
pub fn tables(lines: &[Line]) -> String {
    SCENARIOS
        .iter()
        .map(|sc| table(lines, sc))
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The charts of a record: one per (scenario, measure) with time or rate samples.
pub fn charts(lines: &[Line]) -> Vec<(String, Cdf)> {
    let g = groups(lines);
    let mut out: Vec<(String, Cdf)> = Vec::new();
    for ((sc, m, sys), unit, v) in g {
        let stem = plot::slug(&format!("{sc}-{m}"));
        match out.iter_mut().find(|c| c.1.stem == stem) {
            Some(c) => c.1.series.push((sys, v)),
            None => out.push((
                sc.clone(),
                Cdf {
                    stem,
                    title: format!("{sc}: {m}"),
                    unit,
                    series: vec![(sys, v)],
                },
            )),
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The environment of a record, if it has one.
pub fn environment(lines: &[Line]) -> Option<&Environment> {
    lines.iter().find_map(|l| match l {
        Line::Env(e) => Some(e),
        _ => None,
    })
}

/// One self-contained HTML page: environment, then per scenario its table, skip lines and
/// plots (SVG embedded as data URIs).
pub fn html(lines: &[Line], plots: &[(String, Plotted)]) -> String {
    let mut h = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>ember bench report</title><style>\
         body{font-family:sans-serif;margin:2em;max-width:1100px}\
         table{border-collapse:collapse;margin:1em 0}\
         td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}\
         td:first-child,th:first-child,td.l{text-align:left}\
         .skip{color:#a33}img{max-width:100%;border:1px solid #eee;margin:4px 0}\
         </style></head><body>\n<h1>ember bench report</h1>\n",
    );
    if let Some(e) = environment(lines) {
        h.push_str("<h2>Environment</h2>\n<table>\n");
        let mut kv = vec![
            ("command", e.command.clone()),
            ("started", e.started.clone()),
            ("host kernel", e.host_kernel.clone()),
            ("KVM", e.kvm.clone()),
            ("CPU model", e.cpu_model.clone()),
            ("host CPUs", e.host_cpus.to_string()),
            ("CPU profile", e.cpu_profile.clone()),
            ("guest kernel", e.guest_kernel.clone()),
            ("guest rootfs", e.guest_rootfs.clone()),
            ("ember version", e.ember_version.clone()),
            ("git revision (tree at run time)", e.git_revision.clone()),
        ];
        for (k, v) in &e.peers {
            kv.push(("peer", format!("{k}: {v}")));
        }
        for (k, v) in kv {
            let _ = writeln!(
                h,
                "<tr><th>{}</th><td class=\"l\">{}</td></tr>",
                esc(k),
                esc(&v)
            );
        }
        h.push_str("</table>\n");
    }
    for sc in SCENARIOS {
        let rows = rows(lines, sc);
        let skips = skips(lines, sc);
        if rows.is_empty() && skips.is_empty() {
            continue;
        }
        let _ = writeln!(h, "<h2 id=\"{sc}\">{sc}</h2>");
        if !rows.is_empty() {
            h.push_str(
                "<table><tr><th>measure</th><th>system</th><th>N</th><th>median</th>\
                 <th>p95</th><th>min</th><th>max</th><th>unit</th><th>ember/peer</th></tr>\n",
            );
            for r in &rows {
                let _ = writeln!(
                    h,
                    "<tr><td>{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
                     <td>{}</td><td>{}</td><td class=\"l\">{}</td><td>{}</td></tr>",
                    esc(&r.measure),
                    esc(&r.system),
                    r.summary.n,
                    num(r.summary.median_ms),
                    num(r.summary.p95_ms),
                    num(r.summary.min_ms),
                    num(r.summary.max_ms),
                    esc(&r.unit),
                    esc(&ratio_text(r))
                );
            }
            h.push_str("</table>\n");
        }
        for k in skips {
            let _ = writeln!(h, "<p class=\"skip\">{}</p>", esc(&k));
        }
        for (_, p) in plots.iter().filter(|(s, _)| s == sc) {
            if let Ok(svg) = std::fs::read(&p.svg) {
                let b64 = base64::engine::general_purpose::STANDARD.encode(svg);
                let _ = writeln!(
                    h,
                    "<figure><img alt=\"{}\" src=\"data:image/svg+xml;base64,{b64}\">\
                     <figcaption>{}</figcaption></figure>",
                    esc(&p.title),
                    esc(&p.title)
                );
            }
        }
    }
    // A self-check for headless loads: every embedded plot decoded (`data-images` on body).
    h.push_str(
        "<script>window.addEventListener('load',function(){var im=document.images,bad=0;\
         for(var i=0;i<im.length;i++){if(!im[i].complete||im[i].naturalWidth===0){bad++;}}\
         document.body.setAttribute('data-images',bad?'broken '+bad:'ok '+im.length);\
         if(bad){console.error('ember report: '+bad+' plot(s) did not decode');}});</script>\n",
    );
    h.push_str("</body></html>\n");
    h
}

/// Writes `table.txt`, the plots (`plots/`) and `report.html` of `lines` into `dir`; returns
/// the plots and the problems met (a plot that failed does not stop the rest).
pub fn write_all(dir: &Path, lines: &[Line]) -> (Vec<(String, Plotted)>, Vec<String>) {
    let mut problems = Vec::new();
    let mut plots = Vec::new();
    for (sc, c) in charts(lines) {
        match plot::cdf(&dir.join("plots"), &c) {
            Ok(p) => plots.push((sc, p)),
            Err(e) => problems.push(e.to_string()),
        }
    }
    for (name, text) in [
        ("table.txt", tables(lines)),
        ("report.html", html(lines, &plots)),
    ] {
        if let Err(e) = std::fs::write(dir.join(name), text) {
            problems.push(format!("{}: {e}", dir.join(name).display()));
        }
    }
    (plots, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Sample, Skip};

    fn s(sc: &str, m: &str, sys: &str, v: f64) -> Line {
        Line::Sample(Sample {
            scenario: sc.into(),
            system: sys.into(),
            measure: m.into(),
            unit: "ms".into(),
            run: 0,
            value: v,
            x: None,
        })
    }

    fn record() -> Vec<Line> {
        vec![
            Line::Env(Environment {
                kvm: "kvm_pvm".into(),
                command: "ember bench all <x>".into(),
                ..Default::default()
            }),
            s("boot", "spawn → ready line", "qemu", 40.0),
            s("boot", "spawn → ready line", "ember", 10.0),
            s("boot", "spawn → ready line", "ember", 30.0),
            s("rtt", "run_code", "ember", 2.0),
            Line::Skip(Skip {
                scenario: "boot".into(),
                system: "firecracker".into(),
                reason: "no --firecracker PATH".into(),
            }),
        ]
    }

    #[test]
    fn tables_have_ratios_and_skips() {
        let r = record();
        let rows = rows(&r, "boot");
        assert_eq!(rows[0].system, "ember");
        assert_eq!(rows[1].ember_over_peer, Some(0.5));
        let t = tables(&r);
        assert!(t.contains("== boot =="), "{t}");
        assert!(t.contains("0.50×"), "{t}");
        assert!(
            t.contains("firecracker skipped: no --firecracker PATH"),
            "{t}"
        );
        assert!(t.contains("ember only"), "{t}");
        assert!(!t.contains("== pause =="));
    }

    #[test]
    fn the_html_is_complete_and_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let r = record();
        let (plots, problems) = write_all(dir.path(), &r);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(plots.len(), 2);
        let h = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
        assert!(h.contains("&lt;x&gt;"));
        assert!(h.contains("data:image/svg+xml;base64,"));
        assert!(h.trim_end().ends_with("</html>"));
        assert!(dir.path().join("table.txt").is_file());
    }
}

//! Distribution plots: one empirical CDF per (scenario, measure), one line per system, as SVG
//! and PNG (plotters). Text is drawn with a TrueType font found on the host (DejaVu or
//! Liberation); without one the charts are drawn without text.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

/// One chart's data: a title, a unit and, per system, its values.
#[derive(Debug, Clone)]
pub struct Cdf {
    /// File-name stem (ASCII, no slashes).
    pub stem: String,
    /// Title.
    pub title: String,
    /// Unit of the x axis.
    pub unit: String,
    /// (system, values).
    pub series: Vec<(String, Vec<f64>)>,
}

/// The files of one chart.
#[derive(Debug, Clone)]
pub struct Plotted {
    /// Title.
    pub title: String,
    /// SVG file.
    pub svg: PathBuf,
    /// PNG file.
    pub png: PathBuf,
}

/// Errors drawing.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The drawing backend failed.
    #[error("drawing {}: {detail}", path.display())]
    Draw {
        /// The file.
        path: PathBuf,
        /// Why.
        detail: String,
    },
    /// The output directory.
    #[error("{}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a host font as `sans-serif` once; whether text can be drawn.
fn font_ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        for p in FONTS {
            if let Ok(bytes) = std::fs::read(p) {
                // The font lives as long as the process: plotters keeps a 'static reference.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// The colour of a system's line.
fn color(system: &str, i: usize) -> RGBColor {
    match system {
        "ember" => RGBColor(0xd9, 0x48, 0x01),
        "firecracker" => RGBColor(0x1f, 0x77, 0xb4),
        "qemu" => RGBColor(0x2c, 0xa0, 0x2c),
        _ => {
            let (r, g, b) = Palette99::pick(i).to_rgba().rgb();
            RGBColor(r, g, b)
        }
    }
}

/// The CDF steps of `values`: (value, fraction at or below).
pub fn steps(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len() as f64;
    let mut out = Vec::with_capacity(v.len() * 2);
    for (i, x) in v.iter().enumerate() {
        out.push((*x, i as f64 / n));
        out.push((*x, (i + 1) as f64 / n));
    }
    out
}

fn x_range(c: &Cdf) -> (f64, f64) {
    let all = c.series.iter().flat_map(|s| s.1.iter()).copied();
    let (lo, hi) = all
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
            (l.min(x), h.max(x))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 0.01).max(1e-6);
    (
        (lo - pad).max(if lo >= 0.0 { 0.0 } else { f64::MIN }),
        hi + pad,
    )
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Cdf) -> Result<(), String> {
    let text = font_ready();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (lo, hi) = x_range(c);
    let mut b = ChartBuilder::on(&root);
    b.margin(12);
    if text {
        b.caption(&c.title, ("sans-serif", 18))
            .x_label_area_size(40)
            .y_label_area_size(50);
    }
    let mut chart = b
        .build_cartesian_2d(lo..hi, 0.0..1.02)
        .map_err(|e| e.to_string())?;
    if text {
        chart
            .configure_mesh()
            .x_desc(c.unit.as_str())
            .y_desc("fraction of runs ≤ x")
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
    } else {
        chart
            .configure_mesh()
            .disable_x_mesh()
            .disable_y_mesh()
            .draw()
            .map_err(|e| e.to_string())?;
    }
    for (i, (system, values)) in c.series.iter().enumerate() {
        let col = color(system, i);
        let pts = steps(values);
        let label = format!("{system} (n={})", values.len());
        let series = chart
            .draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if text {
            series.label(label).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2))
            });
        }
        chart
            .draw_series(
                pts.iter()
                    .skip(1)
                    .step_by(2)
                    .map(|&(x, y)| Circle::new((x, y), 3, col.filled())),
            )
            .map_err(|e| e.to_string())?;
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Draws `c` into `dir/<stem>.svg` and `dir/<stem>.png`.
pub fn cdf(dir: &Path, c: &Cdf) -> Result<Plotted, PlotError> {
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let size = (820, 460);
    let svg = dir.join(format!("{}.svg", c.stem));
    let png = dir.join(format!("{}.png", c.stem));
    draw(SVGBackend::new(&svg, size).into_drawing_area(), c).map_err(|detail| PlotError::Draw {
        path: svg.clone(),
        detail,
    })?;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), c).map_err(|detail| {
        PlotError::Draw {
            path: png.clone(),
            detail,
        }
    })?;
    Ok(Plotted {
        title: c.title.clone(),
        svg,
        png,
    })
}

/// A file-name stem from free text.
pub fn slug(s: &str) -> String {
    let mut out = String::new();
    for ch in s.chars() {
        if ch.is_ascii_alphanumeric() {
            out.push(ch.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_climb_to_one() {
        let s = steps(&[3.0, 1.0, 2.0]);
        assert_eq!(s.first(), Some(&(1.0, 0.0)));
        assert_eq!(s.last(), Some(&(3.0, 1.0)));
        assert_eq!(s.len(), 6);
        assert!(steps(&[]).is_empty());
    }

    #[test]
    fn slugs_are_file_names() {
        assert_eq!(
            slug("restore: spawn → ping (default)"),
            "restore-spawn-ping-default"
        );
    }

    #[test]
    fn a_chart_is_drawn_in_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cdf {
            stem: "t".into(),
            title: "boot".into(),
            unit: "ms".into(),
            series: vec![
                ("ember".into(), vec![1.0, 2.0, 3.0]),
                ("qemu".into(), vec![5.0]),
            ],
        };
        let p = cdf(dir.path(), &c).unwrap();
        let svg = std::fs::read_to_string(&p.svg).unwrap();
        assert!(svg.contains("<svg"));
        let png = std::fs::read(&p.png).unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }
}

//! A/B comparison of two records (`ember bench compare A.jsonl B.jsonl`): for every
//! distribution present in both, the change of the median and a two-sided Mann–Whitney U
//! test (exact when both samples are small and untied, normal approximation with tie and
//! continuity corrections otherwise). A difference is flagged when p < alpha.

use crate::record::{groups, Key, Line};
use crate::stats::summarize;

/// One distribution compared.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Comparison {
    /// Scenario.
    pub scenario: String,
    /// Measure.
    pub measure: String,
    /// System.
    pub system: String,
    /// Unit.
    pub unit: String,
    /// Sample sizes.
    pub n_a: usize,
    /// Sample sizes.
    pub n_b: usize,
    /// Medians.
    pub median_a: f64,
    /// Medians.
    pub median_b: f64,
    /// (B − A) / A of the medians, in percent.
    pub change_pct: f64,
    /// The U statistic of sample A.
    pub u: f64,
    /// Two-sided p-value.
    pub p: f64,
    /// p < alpha.
    pub significant: bool,
}

/// Two-sided Mann–Whitney U test of `a` against `b`: (U of `a`, p). `None` when a sample is
/// empty.
pub fn mann_whitney_u(a: &[f64], b: &[f64]) -> Option<(f64, f64)> {
    let (n1, n2) = (a.len(), b.len());
    if n1 == 0 || n2 == 0 {
        return None;
    }
    let mut all: Vec<(f64, bool)> = a
        .iter()
        .map(|&x| (x, true))
        .chain(b.iter().map(|&x| (x, false)))
        .collect();
    all.sort_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    // Average ranks over ties; Σ(t³ − t) for the variance correction.
    let mut r1 = 0.0;
    let mut tie_term = 0.0;
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && all[j + 1].0 == all[i].0 {
            j += 1;
        }
        let rank = (i + j) as f64 / 2.0 + 1.0;
        let t = (j - i + 1) as f64;
        tie_term += t * t * t - t;
        r1 += all[i..=j].iter().filter(|x| x.1).count() as f64 * rank;
        i = j + 1;
    }
    let (f1, f2) = (n1 as f64, n2 as f64);
    let u1 = r1 - f1 * (f1 + 1.0) / 2.0;
    if tie_term == 0.0 && n1 <= 30 && n2 <= 30 {
        return Some((u1, exact_p(n1, n2, u1)));
    }
    let mu = f1 * f2 / 2.0;
    let nn = n as f64;
    let var = f1 * f2 / 12.0 * ((nn + 1.0) - tie_term / (nn * (nn - 1.0)));
    if var <= 0.0 {
        // Every value equal: no evidence of a difference.
        return Some((u1, 1.0));
    }
    let d = (u1 - mu).abs();
    let z = (d - 0.5).max(0.0) / var.sqrt();
    Some((u1, (2.0 * normal_sf(z)).min(1.0)))
}

/// Exact two-sided p of U = `u` for sizes `n1`, `n2` without ties: the share of the
/// C(n1+n2, n1) arrangements whose U is at least as far from its mean.
fn exact_p(n1: usize, n2: usize, u: f64) -> f64 {
    let max_u = n1 * n2;
    // counts[i][u]: arrangements of i values of A among the first (i + j) with statistic u,
    // built column by column over j (values of B).
    let mut prev: Vec<Vec<f64>> = vec![vec![0.0; max_u + 1]; n1 + 1];
    for row in prev.iter_mut() {
        row[0] = 1.0;
    }
    for j in 1..=n2 {
        let mut cur: Vec<Vec<f64>> = vec![vec![0.0; max_u + 1]; n1 + 1];
        cur[0][0] = 1.0;
        for i in 1..=n1 {
            for v in 0..=max_u {
                // The largest value is from B (U unchanged) or from A (it beats all j of B).
                let from_b = prev[i][v];
                let from_a = if v >= j { cur[i - 1][v - j] } else { 0.0 };
                cur[i][v] = from_b + from_a;
            }
        }
        prev = cur;
    }
    let counts = &prev[n1];
    let total: f64 = counts.iter().sum();
    let mean = max_u as f64 / 2.0;
    let d = (u - mean).abs();
    let tail: f64 = counts
        .iter()
        .enumerate()
        .filter(|(v, _)| (*v as f64 - mean).abs() >= d - 1e-9)
        .map(|(_, c)| c)
        .sum();
    (tail / total).min(1.0)
}

/// Upper tail of the standard normal distribution.
fn normal_sf(z: f64) -> f64 {
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// Complementary error function (Chebyshev fit, relative error below 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Compares every distribution present in both records.
pub fn compare(a: &[Line], b: &[Line], alpha: f64) -> Vec<Comparison> {
    let gb = groups(b);
    let mut out = Vec::new();
    for (key, unit, va) in groups(a) {
        let Some((_, _, vb)) = gb.iter().find(|g| g.0 == key) else {
            continue;
        };
        let (Some(sa), Some(sb)) = (summarize(&va), summarize(vb)) else {
            continue;
        };
        let Some((u, p)) = mann_whitney_u(&va, vb) else {
            continue;
        };
        let (scenario, measure, system): Key = key;
        out.push(Comparison {
            scenario,
            measure,
            system,
            unit,
            n_a: sa.n,
            n_b: sb.n,
            median_a: sa.median_ms,
            median_b: sb.median_ms,
            change_pct: if sa.median_ms != 0.0 {
                (sb.median_ms - sa.median_ms) / sa.median_ms.abs() * 100.0
            } else {
                0.0
            },
            u,
            p,
            significant: p < alpha,
        });
    }
    out
}

/// The smallest two-sided p an exact test can reach with these sizes (no ties).
pub fn min_p(n1: usize, n2: usize) -> f64 {
    // Both extreme arrangements out of C(n1 + n2, n1).
    let mut c = 1.0f64;
    for k in 0..n1 {
        c = c * (n2 + n1 - k) as f64 / (k + 1) as f64;
    }
    (2.0 / c).min(1.0)
}

/// The comparison as a table.
pub fn table(rows: &[Comparison], alpha: f64) -> String {
    let mut s = format!(
        "{:<9} {:<44} {:<11} {:>4} {:>4} {:>12} {:>12} {:>9} {:>9}  verdict (alpha {alpha})\n",
        "scenario", "measure", "system", "nA", "nB", "median A", "median B", "change", "p"
    );
    for r in rows {
        let verdict = if r.significant {
            if r.change_pct > 0.0 {
                "CHANGED: higher in B"
            } else {
                "CHANGED: lower in B"
            }
        } else if min_p(r.n_a, r.n_b) >= alpha {
            "too few samples to tell"
        } else {
            "no significant difference"
        };
        s.push_str(&format!(
            "{:<9} {:<44} {:<11} {:>4} {:>4} {:>12} {:>12} {:>8.1}% {:>9.4}  {verdict}\n",
            r.scenario,
            r.measure,
            r.system,
            r.n_a,
            r.n_b,
            format!("{:.3} {}", r.median_a, r.unit),
            format!("{:.3} {}", r.median_b, r.unit),
            r.change_pct,
            r.p
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Sample;

    fn lines(values: &[f64]) -> Vec<Line> {
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                Line::Sample(Sample {
                    scenario: "restore".into(),
                    system: "ember".into(),
                    measure: "spawn → ping".into(),
                    unit: "ms".into(),
                    run: i,
                    value: v,
                    x: None,
                })
            })
            .collect()
    }

    /// A deterministic noisy sample around `base` (±10%).
    fn noisy(base: f64, n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let r = (x >> 33) as f64 / (1u64 << 31) as f64; // [0, 1)
                base * (0.9 + 0.2 * r)
            })
            .collect()
    }

    #[test]
    fn a_two_fold_slowdown_is_flagged() {
        let a = noisy(50.0, 20, 1);
        let b: Vec<f64> = noisy(50.0, 20, 2).iter().map(|v| v * 2.0).collect();
        let rows = compare(&lines(&a), &lines(&b), 0.05);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert!(r.significant, "{r:?}");
        assert!(r.p < 1e-6, "{r:?}");
        assert!(r.change_pct > 80.0 && r.change_pct < 120.0, "{r:?}");
        assert!(table(&rows, 0.05).contains("CHANGED: higher in B"));
        // With ties (normal approximation) too.
        let a: Vec<f64> = a.iter().map(|v| v.round()).collect();
        let b: Vec<f64> = b.iter().map(|v| v.round()).collect();
        assert!(compare(&lines(&a), &lines(&b), 0.05)[0].significant);
    }

    #[test]
    fn the_same_data_twice_is_not_flagged() {
        let a = noisy(50.0, 20, 3);
        let rows = compare(&lines(&a), &lines(&a), 0.05);
        assert_eq!(rows.len(), 1);
        assert!(!rows[0].significant, "{:?}", rows[0]);
        assert!(rows[0].p > 0.9);
        assert_eq!(rows[0].change_pct, 0.0);
        // Two draws of the same distribution are not flagged either.
        let b = noisy(50.0, 20, 4);
        assert!(!compare(&lines(&a), &lines(&b), 0.01)[0].significant);
    }

    #[test]
    fn exact_and_normal_agree_with_known_values() {
        // Complete separation, 5 vs 5: exact two-sided p = 2 / C(10, 5).
        let (u, p) =
            mann_whitney_u(&[1.0, 2.0, 3.0, 4.0, 5.0], &[6.0, 7.0, 8.0, 9.0, 10.0]).unwrap();
        assert_eq!(u, 0.0);
        assert!((p - 2.0 / 252.0).abs() < 1e-12, "{p}");
        assert!((min_p(5, 5) - 2.0 / 252.0).abs() < 1e-12);
        // Interleaved: no evidence.
        let (_, p) = mann_whitney_u(&[1.0, 4.0, 5.0, 8.0], &[2.0, 3.0, 6.0, 7.0]).unwrap();
        assert!(p > 0.5, "{p}");
        // The normal tail.
        assert!((normal_sf(1.959_964) - 0.025).abs() < 1e-6);
        assert!((erfc(-1.0) - 1.842_700_79).abs() < 1e-6);
        // All equal (ties only): p = 1.
        assert_eq!(mann_whitney_u(&[1.0; 40], &[1.0; 40]).unwrap().1, 1.0);
        assert!(mann_whitney_u(&[], &[1.0]).is_none());
    }
}

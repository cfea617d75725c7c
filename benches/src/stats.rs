//! Summary statistics.

/// Median, p95 and friends of a sample, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub median_ms: f64,
    /// 95th percentile (nearest rank).
    pub p95_ms: f64,
    /// Smallest.
    pub min_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// Summarises `samples`; `None` when empty.
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    // Nearest-rank percentile: the smallest value with at least 95% of samples at or below it.
    let rank = ((0.95 * n as f64).ceil() as usize).clamp(1, n);
    Some(Summary {
        n,
        median_ms: median,
        p95_ms: s[rank - 1],
        min_ms: s[0],
        max_ms: s[n - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_p95() {
        let s = summarize(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!(
            (s.n, s.median_ms, s.p95_ms, s.min_ms, s.max_ms),
            (3, 3.0, 5.0, 1.0, 5.0)
        );
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = summarize(&v).unwrap();
        assert_eq!((s.median_ms, s.p95_ms), (50.5, 95.0));
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[f64::NAN]).is_none());
    }
}

//! Summaries of timing samples (median, p90, p99, min) and the plain-text tables the benches print.

use std::fmt::Write;
use std::time::Duration;

/// Order statistics of a set of samples, in nanoseconds (signed, so differences fit too).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// The cells every table starts with after its label: n, median, p90, p99, min.
    pub fn cells(&self) -> [String; 5] {
        [
            self.n.to_string(),
            fmt_ns(self.median),
            fmt_ns(self.p90),
            fmt_ns(self.p99),
            fmt_ns(self.min),
        ]
    }

    /// Summarises samples given in nanoseconds; `None` when there are none.
    pub fn of_nanos(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let last = sorted.len() - 1;
        let at = |q: f64| {
            // Nearest rank, so every reported figure is a sample that was actually seen.
            let rank = (q * sorted.len() as f64).ceil() as usize;
            sorted[rank.saturating_sub(1).min(last)]
        };
        Some(Self {
            n: sorted.len(),
            min: sorted[0],
            median: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: sorted[last],
        })
    }

    pub fn of(samples: &[Duration]) -> Option<Self> {
        Self::of_nanos(&nanos(samples))
    }

    /// Every figure divided by `by` (per file, per tool of a batch).
    pub fn per(&self, by: f64) -> Self {
        Self {
            n: self.n,
            min: self.min / by,
            median: self.median / by,
            p90: self.p90 / by,
            p99: self.p99 / by,
            max: self.max / by,
        }
    }

    /// Operations per second at the median.
    pub fn ops_per_sec(&self) -> f64 {
        if self.median > 0.0 {
            1e9 / self.median
        } else {
            f64::INFINITY
        }
    }
}

pub fn nanos(samples: &[Duration]) -> Vec<f64> {
    samples.iter().map(|d| d.as_nanos() as f64).collect()
}

/// A duration in nanoseconds with a readable unit, e.g. `1.23 ms`, `-40 µs`, `870 ns`.
pub fn fmt_ns(ns: f64) -> String {
    let abs = ns.abs();
    let (value, unit) = if abs >= 1e9 {
        (ns / 1e9, "s")
    } else if abs >= 1e6 {
        (ns / 1e6, "ms")
    } else if abs >= 1e3 {
        (ns / 1e3, "µs")
    } else {
        (ns, "ns")
    };
    let digits = match value.abs() {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        _ => 2,
    };
    format!("{value:.digits$} {unit}")
}

/// A rate such as `1.2 M/s` or `830 /s`.
pub fn fmt_rate(per_sec: f64) -> String {
    if per_sec >= 1e6 {
        format!("{:.2} M/s", per_sec / 1e6)
    } else if per_sec >= 1e3 {
        format!("{:.1} k/s", per_sec / 1e3)
    } else {
        format!("{per_sec:.1} /s")
    }
}

/// A plain-text table with a header row; columns are right-aligned except the first.
#[derive(Debug, Clone, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            rows: vec![header.into_iter().map(Into::into).collect()],
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// The table as text, one line per row, ready to print.
    pub fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|cell| cell.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                let width = widths[c];
                // Writing to a String cannot fail.
                let _ = if c == 0 {
                    write!(line, "{cell:<width$}")
                } else {
                    write!(line, "  {cell:>width$}")
                };
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of_nanos(&samples).unwrap();
        assert_eq!(
            (s.min, s.median, s.p90, s.p99, s.max),
            (1.0, 50.0, 90.0, 99.0, 100.0)
        );
        let one = Summary::of_nanos(&[7.0]).unwrap();
        assert_eq!((one.median, one.p99), (7.0, 7.0));
        assert!(Summary::of_nanos(&[]).is_none());
    }

    #[test]
    fn formats_units() {
        assert_eq!(fmt_ns(870.0), "870 ns");
        assert_eq!(fmt_ns(1_234.0), "1.23 µs");
        assert_eq!(fmt_ns(-45_600.0), "-45.6 µs");
        assert_eq!(fmt_ns(2_500_000_000.0), "2.50 s");
    }
}

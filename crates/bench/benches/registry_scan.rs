//! Registry scan benchmark: cold scans of 10,000 generated `.meta` files, unchanged rescans,
//! and rescans after 10 files were touched (mtime only) or rewritten (new content).

use std::time::Duration;

use toolsrv_bench::scan::{ScanFixture, cold_scan, rescan_after, timed_scan};
use toolsrv_bench::stats::{Summary, Table, fmt_ns, fmt_rate};
use toolsrv_bench::{BenchError, iterations, quick};

/// Files changed before each "after ..." rescan.
const CHANGED: usize = 10;

fn main() -> Result<(), BenchError> {
    let tools = if quick() { 500 } else { 10_000 };
    let fixture = ScanFixture::new(tools)?;
    let bytes: u64 = std::fs::read_dir(fixture.path())?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "registry_scan: {tools} .meta files, {} bytes on average, 1/4 with 2 variants{}",
        bytes / tools as u64,
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    let mut fixture = fixture;

    let cold: Vec<Duration> = (0..iterations(10, 2))
        .map(|_| cold_scan(&fixture))
        .collect::<Result<_, _>>()?;

    let mut scanner = fixture.scanner();
    timed_scan(&mut scanner, tools)?;
    let rescans = iterations(30, 3);
    let mut warm = Vec::with_capacity(rescans);
    let mut touched = Vec::with_capacity(rescans);
    let mut edited = Vec::with_capacity(rescans);
    // Interleaved so that machine noise spreads evenly over the three cases.
    for round in 0..rescans {
        warm.push(rescan_after(&mut fixture, &mut scanner, |_| Ok(()))?);
        touched.push(rescan_after(&mut fixture, &mut scanner, |f| {
            f.touch(CHANGED, round)
        })?);
        edited.push(rescan_after(&mut fixture, &mut scanner, |f| {
            f.edit(CHANGED, round)
        })?);
    }

    let mut table = Table::new([
        "case", "scans", "median", "p90", "p99", "min", "per file", "scans/s",
    ]);
    let cases = [
        ("cold scan (new Scanner)", &cold),
        ("rescan, nothing changed", &warm),
        ("rescan, 10 files touched (mtime)", &touched),
        ("rescan, 10 files rewritten", &edited),
    ];
    for (label, samples) in cases {
        let Some(s) = Summary::of(samples) else {
            continue;
        };
        table.row(
            [label.to_string()]
                .into_iter()
                .chain(s.cells())
                .chain([fmt_ns(s.median / tools as f64), fmt_rate(s.ops_per_sec())]),
        );
    }
    print!("{}", table.render());
    println!("(per file = median / {tools}; p99 of so few scans is their maximum)");
    Ok(())
}

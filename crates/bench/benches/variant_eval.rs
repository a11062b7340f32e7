//! Variant evaluation benchmark: `Meta::resolve(&host)` per tool, without variants, with
//! `os`/`arch` variants and with `binary`/`file` variants probing the real file system.

use toolsrv_bench::stats::{Summary, Table, fmt_ns, fmt_rate, nanos};
use toolsrv_bench::variants::{Case, case_meta, resolve_batch};
use toolsrv_bench::{BenchError, iterations, quick};
use toolsrv_meta::Host;

fn main() -> Result<(), BenchError> {
    let host = Host::current();
    // The binary/file case matches on a file that surely exists.
    let existing = tempfile::NamedTempFile::new()?;
    println!(
        "variant_eval: host {}/{}, {} PATH directories{}",
        host.os,
        host.arch,
        host.path_dirs().count(),
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    let samples = iterations(200, 20);
    let mut table = Table::new(["tool", "ns/tool median", "p90", "p99", "min", "resolves/s"]);
    for case in Case::ALL {
        let meta = case_meta(case, &host, existing.path())?;
        let batch = if case.uses_fs() { 100 } else { 2_000 };
        resolve_batch(&meta, &host, batch);
        let times: Vec<_> = (0..samples)
            .map(|_| resolve_batch(&meta, &host, batch))
            .collect();
        let Some(s) = Summary::of_nanos(&nanos(&times)) else {
            continue;
        };
        let s = s.per(batch as f64);
        table.row([
            case.label().to_string(),
            fmt_ns(s.median),
            fmt_ns(s.p90),
            fmt_ns(s.p99),
            fmt_ns(s.min),
            fmt_rate(s.ops_per_sec()),
        ]);
    }
    print!("{}", table.render());
    println!(
        "(each sample is a batch of consecutive resolves of one tool, divided by the batch size)"
    );
    Ok(())
}

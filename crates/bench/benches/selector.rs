//! Host selectors against 10,000 hosts: the time one selection takes with the compiled globs
//! the coordinator uses (`toolsrv_coordinator::selector`), beside the shared backtracking
//! matcher (`toolsrv_confine::glob`) the selectors used before, for plain selectors and for
//! 4 KiB ones a hostile client could write, against host ids of 9 and of 245 characters.

use std::collections::BTreeMap;
use std::time::Instant;

use toolsrv_bench::stats::{Summary, Table, fmt_ns};
use toolsrv_bench::{BenchError, iterations, quick};
use toolsrv_coordinator::selector::{Candidate, Selector};

/// `n` copies of `term`, comma-separated: as many as fit in the 4 KiB a selector may have.
fn repeated(term: &str) -> String {
    let n = 4096 / (term.len() + 1);
    vec![term; n].join(",")
}

/// Every 20th of the short host ids, named one by one: as many as fit in 4 KiB (409), as a
/// selector generated from an inventory would.
fn named_hosts() -> String {
    let n = 4096 / "web-00000,".len();
    (0..n)
        .map(|i| format!("web-{:05}", i * 20))
        .collect::<Vec<_>>()
        .join(",")
}

/// A Linux host named `id`.
fn candidate<'a>(id: &'a str, labels: &'a BTreeMap<String, String>) -> Candidate<'a> {
    Candidate {
        id,
        os: "linux",
        arch: "amd64",
        hostname: id,
        kernel: "6.1",
        sandbox: "enforced",
        labels,
    }
}

fn main() -> Result<(), BenchError> {
    const HOSTS: usize = 10_000;
    println!(
        "selector: one selection over {HOSTS} hosts{}",
        if quick() { " (BENCH_QUICK)" } else { "" }
    );
    let labels = BTreeMap::new();
    let short: Vec<String> = (0..HOSTS).map(|i| format!("web-{i:05}")).collect();
    let long: Vec<String> = (0..HOSTS)
        .map(|i| format!("{}{i:05}", "a".repeat(240)))
        .collect();
    let selectors = [
        ("web-*", "web-*".to_string()),
        ("web-0012?,db-*", "web-0012?,db-*".to_string()),
        (
            "*aaa…ab (250 a) × 15",
            repeated(&format!("*{}b", "a".repeat(250))),
        ),
        (
            "*a*a…*b (120 a*) × 16",
            repeated(&format!("*{}b", "a*".repeat(120))),
        ),
        ("*a*a…*ab (2,000 *a)", format!("{}b", "*a".repeat(2000))),
        ("*w*e*b…?5 × 1,000", repeated("*w*e*b*?5")),
        ("409 host ids named", named_hosts()),
    ];
    let samples = iterations(7, 2);
    let mut table = Table::new([
        "selector",
        "ids",
        "compiled, median",
        "compiled, max",
        "backtracking, median",
        "matched",
    ]);
    for (label, text) in &selectors {
        let selector = Selector::parse(text)?;
        let terms: Vec<&str> = text.split(',').collect();
        for (kind, ids) in [("9 chars", &short), ("245 chars", &long)] {
            let mut compiled = Vec::new();
            let mut matched = 0;
            for _ in 0..samples {
                let start = Instant::now();
                matched = ids
                    .iter()
                    .filter(|id| selector.matches(&candidate(id, &labels)))
                    .count();
                compiled.push(start.elapsed());
            }
            let mut backtracking = Vec::new();
            for _ in 0..samples.min(3) {
                let start = Instant::now();
                let before = ids
                    .iter()
                    .filter(|id| terms.iter().any(|p| toolsrv_confine::glob(p, id)))
                    .count();
                backtracking.push(start.elapsed());
                assert_eq!(before, matched, "{label}: the two matchers disagree");
            }
            let (Some(c), Some(b)) = (Summary::of(&compiled), Summary::of(&backtracking)) else {
                continue;
            };
            table.row([
                label.to_string(),
                kind.to_string(),
                fmt_ns(c.median),
                fmt_ns(c.max),
                fmt_ns(b.median),
                matched.to_string(),
            ]);
        }
    }
    print!("{}", table.render());
    Ok(())
}

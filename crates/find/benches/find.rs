//! Tool discovery benchmark: index build time and per-request latency against a catalog of
//! 1,000 tools (the evaluation catalog plus generated ones), for the lexical ranker alone and
//! with the encoder, and the recall of each ranker there. Needs the model
//! (`scripts/fetch-find-model`; `TOOLSRV_FIND_MODEL` for another directory).
#![allow(clippy::unwrap_used, clippy::expect_used)] // A benchmark stops at the first failure, saying what failed.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Measures, Query, measure, names};
use toolsrv_find::{Encoder, Hit, Index, Options, VectorStore};

const TOOLS: usize = 1000;

/// Tool names best first for a request.
type Ranking<'a> = dyn Fn(&str) -> Vec<String> + 'a;

/// Which requests a row of the recall table counts.
type KindFilter = dyn Fn(&Query) -> bool;

fn main() {
    let docs = common::big_catalog(TOOLS);
    let queries = common::queries();
    let labelled: Vec<&Query> = queries.iter().filter(|q| q.expected.is_some()).collect();
    let paraphrases: Vec<&Query> = labelled
        .iter()
        .copied()
        .filter(|q| q.kind != "keyword")
        .collect();
    println!(
        "find: {} tools, {} requests ({} sharing no keyword with their tool), {} CPUs",
        docs.len(),
        labelled.len(),
        paraphrases.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    let started = Instant::now();
    let encoder = Arc::new(Encoder::load(&common::model_dir()).expect("the model loads"));
    println!("model load: {:.0?}", started.elapsed());

    let unthresholded = Options {
        min_lexical: 0.0,
        min_fused: 0.0,
        ..Options::default()
    };
    let lexical = Index::with_options(None, unthresholded);
    let started = Instant::now();
    lexical.update(docs.clone()).expect("lexical index");
    let lexical_build = started.elapsed();

    // The vectors are kept as a coordinator with --state-dir keeps them.
    let kept = tempfile::tempdir().expect("a temporary directory");
    let store = || VectorStore::open(kept.path(), &encoder).expect("the vector store");
    let fused = Index::with_options(Some(encoder.clone()), unthresholded).with_store(store());
    let started = Instant::now();
    let built = fused.update(docs.clone()).expect("fused index");
    let fused_build = started.elapsed();
    // The same catalog in a new process: from the kept vectors.
    let restarted = Index::with_options(Some(encoder.clone()), unthresholded).with_store(store());
    let started = Instant::now();
    let rebuilt = restarted
        .update(docs.clone())
        .expect("index from kept vectors");
    let restart_build = started.elapsed();
    assert_eq!(
        (rebuilt.embedded, rebuilt.stored, rebuilt.store_problem),
        (0, built.embedded, None)
    );
    drop(restarted);
    // One tool changed: what the coordinator pays when a .meta is edited.
    let mut edited = docs.clone();
    edited[0].1.description.push_str(" Edited.");
    let started = Instant::now();
    fused.update(edited).expect("update");
    let update_one = started.elapsed();
    fused.update(docs.clone()).expect("update back");
    println!(
        "index build: lexical {lexical_build:.1?}; with encoder {fused_build:.1?} \
         ({} texts embedded); after editing one tool {update_one:.1?}; again from the \
         vectors kept on disk (a restart) {restart_build:.1?}",
        built.embedded
    );

    println!();
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9}",
        "ranker", "median", "p95", "max", "searches"
    );
    let all = |q: &Query| q.query.clone();
    let texts: Vec<String> = labelled.iter().map(|q| all(q)).collect();
    for (label, index) in [("lexical", &lexical), ("fused (encoder)", &fused)] {
        let mut times = Vec::new();
        for _ in 0..3 {
            for q in &texts {
                let started = Instant::now();
                let hits = index.search(q, 5, |_| true).expect("search");
                times.push(started.elapsed());
                std::hint::black_box(hits);
            }
        }
        let (median, p95, max) = percentiles(&mut times);
        println!(
            "{label:<22} {:>9} {:>9} {:>9} {:>9}",
            ms(median),
            ms(p95),
            ms(max),
            times.len()
        );
    }
    // The encoder alone: one request through the model, the part of a fused search that is not
    // the dot products.
    let mut times = Vec::new();
    for q in &texts {
        let started = Instant::now();
        std::hint::black_box(encoder.embed(&[q.as_str()]).expect("embed"));
        times.push(started.elapsed());
    }
    let (median, p95, max) = percentiles(&mut times);
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9}",
        "encode request only",
        ms(median),
        ms(p95),
        ms(max),
        times.len()
    );

    println!();
    println!("recall among {} tools:", docs.len());
    let everything = |index: &Index<String>, q: &str| -> Vec<Hit<String>> {
        index.search(q, usize::MAX, |_| true).expect("search")
    };
    let semantic_order = |q: &str| {
        let mut hits = everything(&fused, q);
        hits.sort_by(|a, b| {
            b.semantic
                .unwrap_or(-1.0)
                .total_cmp(&a.semantic.unwrap_or(-1.0))
        });
        names(&hits)
    };
    let rows: [(&str, Box<Ranking>); 3] = [
        ("lexical", Box::new(|q| names(&everything(&lexical, q)))),
        ("encoder", Box::new(semantic_order)),
        ("fused", Box::new(|q| names(&everything(&fused, q)))),
    ];
    let kinds: [(&str, &KindFilter); 4] = [
        ("all", &|_| true),
        ("no-keyword", &|q| q.kind == "no-keyword"),
        ("paraphrase", &|q| q.kind == "paraphrase"),
        ("any paraphrase", &|q| q.kind != "keyword"),
    ];
    for (label, rank) in &rows {
        for (kind, keep) in &kinds {
            let m: Measures = measure(labelled.iter().copied().filter(|q| keep(q)), rank);
            println!("{label:<8} {kind:<15} {m}");
        }
    }
}

fn percentiles(times: &mut [Duration]) -> (Duration, Duration, Duration) {
    times.sort();
    let at = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.95), at(1.0))
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

//! Ranking quality on the evaluation set (`eval/`): recall@1, recall@3 and MRR of the lexical
//! ranker, the encoder alone and the fused score, held above floors a little under what they
//! measure. The encoder tests fetch the model with `scripts/fetch-find-model` when it is absent.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{Measures, Query, measure, names};
use toolsrv_find::{Analyzer, Doc, Encoder, Hit, Index, Options};

/// The requests of one kind; "all" is every request, "any paraphrase" both kinds of paraphrase
/// (every request that shares no keyword with its tool).
fn of_kind<'a>(queries: &'a [Query], kind: &'a str) -> impl Iterator<Item = &'a Query> + 'a {
    queries.iter().filter(move |q| match kind {
        "all" => true,
        "any paraphrase" => q.kind == "paraphrase" || q.kind == "no-keyword",
        kind => q.kind == kind,
    })
}

/// The kinds every ranker is reported on.
const KINDS: [&str; 5] = [
    "all",
    "keyword",
    "no-keyword",
    "paraphrase",
    "any paraphrase",
];

/// Every document with both component scores, none dropped by the threshold.
fn unfiltered(index: &Index<String>, query: &str) -> Vec<Hit<String>> {
    index.search(query, usize::MAX, |_| true).unwrap()
}

fn report(label: &str, m: Measures) {
    println!("{label:<28} {m}");
}

#[test]
fn the_set_is_big_enough_and_paraphrases_share_no_word_with_their_tool() {
    let docs = common::catalog();
    let queries = common::queries();
    let tuning = common::tuning_queries();
    let holdout = common::holdout_queries();
    assert!(docs.len() >= 40, "{} tools", docs.len());
    assert!(
        tuning
            .iter()
            .all(|t| t.kind != "keyword" && queries.iter().all(|q| q.query != t.query)),
        "the tuning set holds only paraphrases, none of them an evaluation request"
    );
    assert!(
        holdout
            .iter()
            .all(|h| h.kind != "keyword"
                && queries.iter().chain(&tuning).all(|q| q.query != h.query)),
        "the held-out set holds only paraphrases, none of them in another set"
    );
    for set in [&tuning, &holdout] {
        for tool in docs.iter().map(|(name, _)| name) {
            for kind in ["paraphrase", "no-keyword"] {
                let n = set
                    .iter()
                    .filter(|q| q.expected.as_ref() == Some(tool) && q.kind == kind)
                    .count();
                assert_eq!(
                    n,
                    1,
                    "{tool}: {n} {kind} requests in a set of {}",
                    set.len()
                );
            }
        }
    }
    let labelled: Vec<&Query> = queries.iter().filter(|q| q.expected.is_some()).collect();
    assert!(labelled.len() >= 80, "{} labelled queries", labelled.len());
    // Both kinds of paraphrase share no keyword with their tool.
    let paraphrases = labelled.iter().filter(|q| q.kind != "keyword").count();
    assert!(
        paraphrases * 2 >= labelled.len(),
        "{paraphrases} paraphrases"
    );
    let analyzer = Analyzer::default();
    for q in queries.iter().chain(&tuning).chain(&holdout) {
        if let Some(expected) = &q.expected {
            let (_, doc) = docs
                .iter()
                .find(|(n, _)| n == expected)
                .unwrap_or_else(|| panic!("{:?}: no tool {expected}", q.query));
            match q.kind.as_str() {
                "paraphrase" => {
                    let shared = common::shared_terms(&analyzer, &q.query, doc);
                    assert!(
                        shared.is_empty(),
                        "{:?} shares {shared:?} with {expected}",
                        q.query
                    );
                }
                "no-keyword" => {
                    let keywords_only = Doc {
                        description: String::new(),
                        prompt: String::new(),
                        ..doc.clone()
                    };
                    let shared = common::shared_terms(&analyzer, &q.query, &keywords_only);
                    assert!(
                        shared.is_empty(),
                        "{:?} shares {shared:?} with the name or keywords of {expected}",
                        q.query
                    );
                }
                kind => assert_eq!(kind, "keyword", "{:?}", q.query),
            }
        } else {
            assert_eq!(q.kind, "none", "{:?}", q.query);
        }
    }
}

#[test]
fn lexical_ranking_meets_its_floor() {
    let queries = common::queries();
    let all = Index::with_options(
        None,
        Options {
            min_lexical: 0.0,
            ..Options::default()
        },
    );
    all.update(common::catalog()).unwrap();
    let rank = |q: &str| names(&unfiltered(&all, q));
    let m: Vec<Measures> = KINDS
        .iter()
        .map(|kind| {
            let m = measure(of_kind(&queries, kind), rank);
            report(&format!("lexical, {kind}"), m);
            m
        })
        .collect();
    let (everything, keyword, no_keyword) = (m[0], m[1], m[2]);
    // Paraphrases share no word with their tool by construction: the lexical ranker finds
    // next to none of them; requests without the tool's keywords it finds by the words they
    // share with its description and prompt, less than half of them.
    assert!(everything.at3 >= 0.43, "{everything}");
    assert!(keyword.at1 >= 0.90, "{keyword}");
    assert!(no_keyword.at3 >= 0.38, "{no_keyword}");

    // The threshold keeps what keyword requests are after and drops requests about nothing.
    let index = Index::new(None);
    index.update(common::catalog()).unwrap();
    for q in of_kind(&queries, "none") {
        let hits = index.search(&q.query, 5, |_| true).unwrap();
        assert!(hits.is_empty(), "{:?} matched {:?}", q.query, names(&hits));
    }
    let kept = measure(of_kind(&queries, "keyword"), |q| {
        names(&index.search(q, 3, |_| true).unwrap())
    });
    assert!(kept.at3 >= keyword.at3 - 0.02, "{kept} vs {keyword}");
}

/// Recall of the encoder alone and of the fused score, per kind of [`KINDS`], and every
/// request's hits with no threshold.
struct Ranked {
    semantic: Vec<Measures>,
    fused: Vec<Measures>,
    /// The fused score on the tuning set (`dev.jsonl`), every request a paraphrase.
    tuning: Measures,
    /// The fused score on the held-out set (`holdout.jsonl`), every request a paraphrase.
    holdout: Measures,
    hits: HashMap<String, Vec<Hit<String>>>,
}

/// Ranks every request with `encoder` (no threshold) and prints each ranker's measures per kind.
fn rank_with(encoder: &Arc<Encoder>, label: &str) -> Ranked {
    let queries = common::queries();
    let tuning = common::tuning_queries();
    let holdout = common::holdout_queries();
    let all = Index::with_options(
        Some(encoder.clone()),
        Options {
            min_fused: 0.0,
            ..Options::default()
        },
    );
    all.update(common::catalog()).unwrap();
    // Each request through the encoder once; every ranking below reorders these hits.
    let cache: HashMap<String, Vec<Hit<String>>> = queries
        .iter()
        .chain(&tuning)
        .chain(&holdout)
        .map(|q| (q.query.clone(), unfiltered(&all, &q.query)))
        .collect();
    let semantic = |q: &str| {
        let mut hits = cache[q].clone();
        hits.sort_by(|a, b| b.semantic.unwrap().total_cmp(&a.semantic.unwrap()));
        names(&hits)
    };
    let fused = |q: &str| names(&cache[q]);
    let rrf = |q: &str| common::rrf(&cache[q]);
    let (mut semantic_measures, mut fused_measures) = (Vec::new(), Vec::new());
    for kind in KINDS {
        let s = measure(of_kind(&queries, kind), semantic);
        let f = measure(of_kind(&queries, kind), fused);
        report(&format!("{label} encoder, {kind}"), s);
        report(&format!("{label} fused, {kind}"), f);
        report(
            &format!("{label} rrf, {kind}"),
            measure(of_kind(&queries, kind), rrf),
        );
        semantic_measures.push(s);
        fused_measures.push(f);
    }
    let tuning = measure(&tuning, fused);
    report(&format!("{label} fused, tuning set"), tuning);
    let holdout = measure(&holdout, fused);
    report(&format!("{label} fused, held-out set"), holdout);
    Ranked {
        semantic: semantic_measures,
        fused: fused_measures,
        tuning,
        holdout,
        hits: cache,
    }
}

/// What each threshold would keep: recall@3 of the labelled requests, and how many requests
/// about nothing would still find something, from hits ranked with no threshold.
fn print_thresholds(ranked: &Ranked, label: &str) {
    let queries = common::queries();
    for t in [0.16f32, 0.18, 0.20, 0.22] {
        let kept = |q: &str| -> Vec<String> {
            let kept: Vec<Hit<String>> = ranked.hits[q]
                .iter()
                .filter(|h| h.relevance >= t)
                .take(3)
                .cloned()
                .collect();
            names(&kept)
        };
        let para = measure(of_kind(&queries, "any paraphrase"), kept);
        let everything = measure(of_kind(&queries, "all"), kept);
        let noise = of_kind(&queries, "none")
            .filter(|q| !kept(&q.query).is_empty())
            .count();
        println!(
            "{label} threshold {t:.2}: R@3 all {:.3}, any paraphrase {:.3}; \
             {noise} unrelated requests match",
            everything.at3, para.at3
        );
    }
}

/// With the default threshold: requests about nothing find at most `max_noise` weak hits, the
/// others keep their tool; an edit re-embeds one tool; odd requests go through the model.
/// Returns recall with the threshold on every request.
fn check_threshold_and_updates(encoder: Arc<Encoder>, label: &str, max_noise: usize) -> Measures {
    let queries = common::queries();
    let index = Index::new(Some(encoder));
    let first = index.update(common::catalog()).unwrap();
    assert_eq!(first.reused, 0);
    // An update that changes one tool's description embeds that tool's summary only.
    let mut changed = common::catalog();
    changed[0].1.description.push_str(" Also on weekends.");
    let second = index.update(changed).unwrap();
    assert_eq!((second.embedded, second.reused), (1, first.embedded - 1));
    index.update(common::catalog()).unwrap();
    let mut noise = 0;
    for q in of_kind(&queries, "none") {
        let hits = index.search(&q.query, 5, |_| true).unwrap();
        noise += usize::from(!hits.is_empty());
        assert!(
            hits.iter().all(|h| h.score < 0.2),
            "{label}: {:?} matched {hits:?}",
            q.query
        );
    }
    assert!(
        noise <= max_noise,
        "{label}: {noise} unrelated requests match"
    );
    let kept = measure(of_kind(&queries, "all"), |q| {
        names(&index.search(q, 3, |_| true).unwrap())
    });
    report(&format!("{label} fused with threshold, all"), kept);
    // Odd requests through the tokenizer and the model: no panic, no error.
    let long = "a".repeat(toolsrv_find::MAX_QUERY_BYTES);
    for q in [
        "\0\0disk\0",
        "\u{fffd}\u{202e}??",
        "日本語のログ 🔥",
        "the of and",
        &long,
    ] {
        let hits = index.search(q, 5, |_| true).unwrap();
        assert!(
            hits.iter().all(|h| (0.0..=1.0).contains(&h.score)),
            "{label}: {q:?}"
        );
    }
    kept
}

/// Holds a ranking to floors a little under what it measures (BENCHMARKS.md "find"): recall@3
/// per kind of [`KINDS`] for the encoder alone and for the fused score (0: not held), and
/// recall@1 of the fused score on keyword requests.
fn hold(
    r: &Ranked,
    semantic_at3: [f64; 5],
    fused_at3: [f64; 5],
    keyword_at1: f64,
    tuning_at3: f64,
    holdout_at3: f64,
) {
    assert!(
        r.tuning.at3 >= tuning_at3,
        "fused, tuning set: {}",
        r.tuning
    );
    assert!(
        r.holdout.at3 >= holdout_at3,
        "fused, held-out set: {}",
        r.holdout
    );
    for (i, kind) in KINDS.iter().enumerate() {
        let (s, f) = (r.semantic[i], r.fused[i]);
        assert!(s.at3 >= semantic_at3[i], "encoder, {kind}: {s}");
        assert!(f.at3 >= fused_at3[i], "fused, {kind}: {f}");
    }
    assert!(
        r.fused[1].at1 >= keyword_at1,
        "fused, keyword: {}",
        r.fused[1]
    );
}

#[test]
fn encoder_and_fusion_meet_their_floors() {
    let encoder = Arc::new(Encoder::load(&common::model_dir()).unwrap());
    let r = rank_with(&encoder, "MiniLM");
    // The goal for paraphrases is 0.9 recall@3; this model, centred and corrected for hubness,
    // reaches about 0.84 on requests without their tool's keywords and 0.79 on those sharing no
    // word with it at all; 0.71 of the tuning set's paraphrases and 0.79 of the held-out
    // set's. Order: all, keyword, no-keyword, paraphrase, any paraphrase.
    hold(
        &r,
        [0.85, 0.0, 0.0, 0.76, 0.0],
        [0.85, 0.0, 0.80, 0.76, 0.80],
        0.93,
        0.68,
        0.75,
    );
    print_thresholds(&r, "MiniLM");
    // The default threshold (0.18, from the table: 0.22 would drop every unrelated request but
    // a quarter of the paraphrases with them).
    let kept = check_threshold_and_updates(encoder, "MiniLM", 2);
    assert!(kept.at3 >= 0.82, "{kept} vs {}", r.fused[0]);
}

#[test]
fn the_larger_encoder_meets_its_floors() {
    let encoder = Arc::new(Encoder::load(&toolsrv_testkit::mpnet_model_dir()).unwrap());
    let r = rank_with(&encoder, "MPNet");
    // all-mpnet-base-v2 with 8-bit weights: about 0.95 on requests without their tool's
    // keywords, 0.84 on those sharing no word with it, 0.89 on both (the goal, 0.9, not met);
    // 0.84 of the tuning set's paraphrases, 0.875 of the held-out set's.
    hold(
        &r,
        [0.0; 5],
        [0.90, 0.0, 0.92, 0.80, 0.87],
        0.93,
        0.82,
        0.85,
    );
    print_thresholds(&r, "MPNet");
    let kept = check_threshold_and_updates(encoder, "MPNet", 2);
    assert!(kept.at3 >= 0.82, "{kept} vs {}", r.fused[0]);
}

//! Ranking quality on the evaluation set (`eval/`): recall@1, recall@3 and MRR of the lexical
//! ranker, the encoder alone and the fused score, held above floors a little under what they
//! measure. The encoder tests fetch the model with `scripts/fetch-find-model` when it is absent.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{Measures, Query, measure, names};
use toolsrv_find::{Analyzer, Encoder, Hit, Index, Options};

fn of_kind<'a>(queries: &'a [Query], kind: &'a str) -> impl Iterator<Item = &'a Query> + 'a {
    queries
        .iter()
        .filter(move |q| kind == "all" || q.kind == kind)
}

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
    assert!(docs.len() >= 40, "{} tools", docs.len());
    let labelled: Vec<&Query> = queries.iter().filter(|q| q.expected.is_some()).collect();
    assert!(labelled.len() >= 80, "{} labelled queries", labelled.len());
    let paraphrases = labelled.iter().filter(|q| q.kind == "paraphrase").count();
    assert!(
        paraphrases * 2 >= labelled.len(),
        "{paraphrases} paraphrases"
    );
    let analyzer = Analyzer::default();
    for q in &queries {
        if let Some(expected) = &q.expected {
            let (_, doc) = docs
                .iter()
                .find(|(n, _)| n == expected)
                .unwrap_or_else(|| panic!("{:?}: no tool {expected}", q.query));
            if q.kind == "paraphrase" {
                let shared = common::shared_terms(&analyzer, &q.query, doc);
                assert!(
                    shared.is_empty(),
                    "{:?} shares {shared:?} with {expected}",
                    q.query
                );
            } else {
                assert_eq!(q.kind, "keyword", "{:?}", q.query);
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
    let everything = measure(of_kind(&queries, "all"), rank);
    let keyword = measure(of_kind(&queries, "keyword"), rank);
    let paraphrase = measure(of_kind(&queries, "paraphrase"), rank);
    report("lexical, all", everything);
    report("lexical, keyword", keyword);
    report("lexical, paraphrase", paraphrase);
    // Paraphrases share no word with their tool by construction: the lexical ranker finds
    // next to none of them, and its recall on everything is about its recall on keywords / 2.
    assert!(everything.at3 >= 0.45, "{everything}");
    assert!(everything.mrr >= 0.45, "{everything}");
    assert!(keyword.at1 >= 0.90, "{keyword}");

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

#[test]
fn encoder_and_fusion_meet_their_floors() {
    let queries = common::queries();
    let encoder = Arc::new(Encoder::load(&common::model_dir()).unwrap());
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
        .map(|q| (q.query.clone(), unfiltered(&all, &q.query)))
        .collect();
    let unfiltered = |_: &Index<String>, q: &str| cache[q].clone();
    let semantic = |q: &str| {
        let mut hits = unfiltered(&all, q);
        hits.sort_by(|a, b| b.semantic.unwrap().total_cmp(&a.semantic.unwrap()));
        names(&hits)
    };
    let fused = |q: &str| names(&unfiltered(&all, q));
    let rrf = |q: &str| common::rrf(&unfiltered(&all, q));
    let mut results = Vec::new();
    for kind in ["all", "keyword", "paraphrase"] {
        let s = measure(of_kind(&queries, kind), semantic);
        let f = measure(of_kind(&queries, kind), fused);
        let r = measure(of_kind(&queries, kind), rrf);
        report(&format!("encoder, {kind}"), s);
        report(&format!("fused, {kind}"), f);
        report(&format!("rrf, {kind}"), r);
        results.push((kind, s, f));
    }
    let (_, sem_all, fused_all) = results[0];
    let (_, _, fused_keyword) = results[1];
    let (_, sem_para, fused_para) = results[2];
    // Floors a little under the measures (BENCHMARKS.md). The goal for paraphrases is 0.9
    // recall@3; this model, centred and corrected for hubness, reaches about 0.79 on requests
    // that share no word with their tool.
    assert!(sem_all.at3 >= 0.86, "{sem_all}");
    assert!(sem_para.at3 >= 0.76, "{sem_para}");
    assert!(fused_all.at3 >= 0.86, "{fused_all}");
    assert!(fused_keyword.at1 >= 0.93, "{fused_keyword}");
    assert!(fused_para.at3 >= 0.76, "{fused_para}");

    // What each threshold would keep: recall@3 of the labelled requests, and how many requests
    // about nothing would still find something. The threshold applies to the plain score (see
    // the crate documentation), which hits do not carry: one index per threshold.
    for t in [0.16f32, 0.18, 0.20, 0.22] {
        let index = Index::with_options(
            Some(encoder.clone()),
            Options {
                min_fused: t,
                ..Options::default()
            },
        );
        index.update(common::catalog()).unwrap();
        let kept = |q: &str| names(&index.search(q, 3, |_| true).unwrap());
        let para = measure(of_kind(&queries, "paraphrase"), kept);
        let everything = measure(of_kind(&queries, "all"), kept);
        let noise = of_kind(&queries, "none")
            .filter(|q| !kept(&q.query).is_empty())
            .count();
        println!(
            "threshold {t:.2}: R@3 all {:.3}, paraphrase {:.3}; {noise} unrelated requests match",
            everything.at3, para.at3
        );
    }

    // With the threshold (0.18, chosen from the table above: 0.22 would drop every unrelated
    // request but a quarter of the paraphrases with them): requests about nothing find at most
    // a weak hit, the others keep their tool.
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
            "{:?} matched {hits:?}",
            q.query
        );
    }
    assert!(noise <= 2, "{noise} unrelated requests match");
    let kept = measure(of_kind(&queries, "all"), |q| {
        names(&index.search(q, 3, |_| true).unwrap())
    });
    report("fused with threshold, all", kept);
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
        assert!(hits.iter().all(|h| (0.0..=1.0).contains(&h.score)), "{q:?}");
    }
    assert!(kept.at3 >= 0.84, "{kept} vs {fused_all}");
}

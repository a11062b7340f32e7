//! Odd requests and odd documents: empty, only stop words, 4 KiB of one character, NULs,
//! unpaired surrogates turned replacement characters, control characters, random bytes read as
//! UTF-8. No panic, scores within 0..1, and each search well within a second (lexical ranker;
//! the encoder's input is cut to 256 tokens whatever the request).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

mod common;

use std::time::{Duration, Instant};

use toolsrv_find::{Doc, FindError, Index, MAX_QUERY_BYTES};

fn odd_queries() -> Vec<String> {
    let mut queries: Vec<String> = [
        "",
        " ",
        "the of and to is",
        "?!?!?! ... ---",
        "\0\0\0",
        "disk\0usage",
        "\u{fffd}\u{fffd}",
        "\u{202e}disk\u{202c} usage",
        "ÅNGSTRÖM İstanbul ß ﬁ",
        "🔥🔥 cpu 🔥🔥",
        "日本語のログ",
        "\t\r\n\u{7}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    queries.push("a".repeat(MAX_QUERY_BYTES));
    queries.push("é".repeat(MAX_QUERY_BYTES / 2));
    queries.push("disk ".repeat(MAX_QUERY_BYTES / 5));
    queries.push("x_".repeat(MAX_QUERY_BYTES / 2));
    let mut rng = fastrand::Rng::with_seed(7);
    for _ in 0..300 {
        let len = rng.usize(0..=MAX_QUERY_BYTES);
        let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        queries.push(
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(len)
                .collect::<String>(),
        );
        let words: Vec<&str> = (0..rng.usize(0..40))
            .map(|_| {
                ["disk", "the", "_", "-", "restart", "\0", "ünï", "4412", " "][rng.usize(0..9)]
            })
            .collect();
        queries.push(words.concat());
    }
    queries
        .into_iter()
        .map(|q| {
            // Keep within the bound at a character boundary: the bound itself is tested below.
            let mut end = q.len().min(MAX_QUERY_BYTES);
            while !q.is_char_boundary(end) {
                end -= 1;
            }
            q[..end].to_string()
        })
        .collect()
}

#[test]
fn odd_requests_neither_panic_nor_take_long() {
    let index = Index::new(None);
    index.update(common::big_catalog(1000)).unwrap();
    let mut slowest = Duration::ZERO;
    for q in odd_queries() {
        let started = Instant::now();
        let hits = index.search(&q, 10, |_| true).unwrap();
        slowest = slowest.max(started.elapsed());
        assert!(hits.len() <= 10);
        for h in &hits {
            assert!((0.0..=1.0).contains(&h.score), "{q:?}: {h:?}");
        }
    }
    // Debug build, shared machine: a generous bound, far from any pathological case.
    assert!(
        slowest < Duration::from_secs(1),
        "slowest search {slowest:?}"
    );
    assert!(matches!(
        index.search(&"a".repeat(MAX_QUERY_BYTES + 1), 10, |_| true),
        Err(FindError::QueryTooLong { .. })
    ));
}

#[test]
fn odd_documents_index_and_search() {
    let odd = odd_queries();
    let docs: Vec<(usize, Doc)> = odd
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let doc = Doc {
                name: text.chars().take(64).collect(),
                description: text.clone(),
                prompt: text.repeat(2),
                keywords: vec![text.clone(), String::new()],
            };
            (i, doc)
        })
        .collect();
    let index = Index::new(None);
    index.update(docs).unwrap();
    for q in odd.iter().take(40) {
        let hits = index.search(q, 5, |k| k % 2 == 0).unwrap();
        assert!(hits.iter().all(|h| h.key % 2 == 0));
    }
    index.update(Vec::new()).unwrap();
    assert!(index.search("disk", 5, |_| true).unwrap().is_empty());
}

//! Builds a word index of 256 tools whose prompts are 250 KB each (what a host may send of its
//! own tools, at most, on every change of its view), twice, and prints how long each build
//! took: `cargo run --release -p toolsrv-find --example long_texts`. BENCHMARKS.md, "find".

use std::time::Instant;
use toolsrv_find::{Doc, Index};
fn main() -> Result<(), toolsrv_find::FindError> {
    // A vocabulary of 5,000 made-up words, drawn from in a fixed order.
    let words: Vec<String> = (0..5000)
        .map(|i| format!("w{i}x{}", i * 7919 % 1000))
        .collect();
    let mut seed = 1u64;
    let mut text = |n: usize| {
        let mut s = String::with_capacity(n);
        while s.len() < n {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            s.push_str(&words[(seed >> 33) as usize % words.len()]);
            s.push(' ');
        }
        s
    };
    let docs: Vec<(String, Doc)> = (0..256)
        .map(|i| {
            (
                format!("t{i}"),
                Doc {
                    name: format!("t{i}"),
                    description: text(1000),
                    prompt: text(250_000),
                    keywords: vec![],
                },
            )
        })
        .collect();
    for round in 0..2 {
        let index: Index<String> = Index::new(None);
        let t = Instant::now();
        index.update(docs.clone())?;
        println!(
            "round {round}: build of 256 docs of 250 KB: {:?}",
            t.elapsed()
        );
    }
    Ok(())
}

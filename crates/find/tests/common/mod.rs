//! The evaluation set (`eval/`) and the measures over it, shared by the tests and the benchmark.

#![allow(dead_code)] // Each test binary uses part of it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Tests fail loudly by design.

pub mod generated;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use toolsrv_find::{Analyzer, Doc, Hit};
use toolsrv_meta::ToolDef;
use toolsrv_registry::Scanner;

pub fn eval_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("eval")
}

/// The evaluation catalog as the registry loads it, one document per tool from its top-level
/// texts (variants of these tools do not change them).
pub fn catalog() -> Vec<(String, Doc)> {
    let catalog = Scanner::new(vec![eval_dir().join("tools")]).scan();
    assert!(
        catalog.invalid.is_empty() && !catalog.has_errors(),
        "the evaluation catalog does not load: {:?}",
        catalog.diagnostics
    );
    catalog
        .tools
        .iter()
        .map(|(name, tool)| (name.clone(), doc(name, &tool.meta.def)))
        .collect()
}

pub fn doc(name: &str, def: &ToolDef) -> Doc {
    Doc {
        name: name.to_string(),
        description: def.description.clone().unwrap_or_default(),
        prompt: def.prompt.clone().unwrap_or_default(),
        keywords: def.keywords.clone().unwrap_or_default(),
    }
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct Query {
    pub query: String,
    /// `None` for a request no tool serves: nothing should be returned.
    pub expected: Option<String>,
    pub kind: String,
}

/// The evaluation requests (`queries.jsonl`): held out, never tuned on.
pub fn queries() -> Vec<Query> {
    read_queries("queries.jsonl")
}

/// The tuning requests (`dev.jsonl`): 112 paraphrases, one of each kind per tool, written
/// after the evaluation set to try ranking changes on before they are measured on it.
pub fn tuning_queries() -> Vec<Query> {
    read_queries("dev.jsonl")
}

/// The held-out requests (`holdout.jsonl`): 112 paraphrases, one of each kind per tool, written
/// after the tuning set and before anything was measured on them; a setting chosen on the tuning
/// set is measured here once, as well as on the evaluation set.
pub fn holdout_queries() -> Vec<Query> {
    read_queries("holdout.jsonl")
}

fn read_queries(file: &str) -> Vec<Query> {
    let text = std::fs::read_to_string(eval_dir().join(file)).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// The stemmed terms a paraphrase must not share with its tool's texts.
pub fn shared_terms(analyzer: &Analyzer, query: &str, doc: &Doc) -> BTreeSet<String> {
    let text = format!(
        "{}\n{}\n{}\n{}",
        doc.name,
        doc.description,
        doc.keywords.join("\n"),
        doc.prompt
    );
    let doc_terms: BTreeSet<String> = analyzer.terms(&text).into_iter().collect();
    analyzer
        .terms(query)
        .into_iter()
        .filter(|t| doc_terms.contains(t))
        .collect()
}

/// Recall@1, recall@3 and mean reciprocal rank of one ranker over labelled queries.
#[derive(Debug, Clone, Copy, Default)]
pub struct Measures {
    pub queries: usize,
    pub at1: f64,
    pub at3: f64,
    pub mrr: f64,
}

impl std::fmt::Display for Measures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "n={:3}  R@1 {:.3}  R@3 {:.3}  MRR {:.3}",
            self.queries, self.at1, self.at3, self.mrr
        )
    }
}

/// Measures a ranking: `rank(query)` gives tool names best first.
pub fn measure<'q>(
    queries: impl IntoIterator<Item = &'q Query>,
    mut rank: impl FnMut(&str) -> Vec<String>,
) -> Measures {
    let mut m = Measures::default();
    for q in queries {
        let Some(expected) = &q.expected else {
            continue;
        };
        let ranked = rank(&q.query);
        let pos = ranked.iter().position(|n| n == expected);
        m.queries += 1;
        if pos == Some(0) {
            m.at1 += 1.0;
        }
        if pos.is_some_and(|p| p < 3) {
            m.at3 += 1.0;
        }
        if let Some(p) = pos {
            m.mrr += 1.0 / (p as f64 + 1.0);
        }
    }
    let n = m.queries.max(1) as f64;
    m.at1 /= n;
    m.at3 /= n;
    m.mrr /= n;
    m
}

pub fn names(hits: &[Hit<String>]) -> Vec<String> {
    hits.iter().map(|h| h.key.clone()).collect()
}

/// Reciprocal rank fusion of two rankings (k = 60, as in Cormack et al.), for comparison with
/// the weighted score the index uses.
pub fn rrf(hits: &[Hit<String>]) -> Vec<String> {
    let order = |key: fn(&Hit<String>) -> f32| {
        let mut v: Vec<&Hit<String>> = hits.iter().collect();
        v.sort_by(|a, b| key(b).total_cmp(&key(a)));
        v.into_iter().map(|h| h.key.clone()).collect::<Vec<_>>()
    };
    let lex = order(|h| h.lexical.unwrap_or(0.0));
    let sem = order(|h| h.semantic.unwrap_or(-1.0));
    let mut fused: Vec<(String, f64)> = hits
        .iter()
        .map(|h| {
            let r = |list: &[String]| {
                let p = list.iter().position(|n| *n == h.key).unwrap_or(list.len());
                1.0 / (60.0 + p as f64 + 1.0)
            };
            // A document the lexical ranker did not match at all gets no lexical share.
            let lexical = if h.lexical.unwrap_or(0.0) > 0.0 {
                r(&lex)
            } else {
                0.0
            };
            (h.key.clone(), lexical + r(&sem))
        })
        .collect();
    fused.sort_by(|a, b| b.1.total_cmp(&a.1));
    fused.into_iter().map(|(k, _)| k).collect()
}

/// The model directory, fetched there when missing (see `toolsrv_testkit::find_model_dir`).
pub fn model_dir() -> PathBuf {
    toolsrv_testkit::find_model_dir()
}

/// A synthetic catalog of `n` tools (the evaluation catalog first, then made-up ones in the
/// same style), for timing searches against a fleet-sized catalog and for ranking the real
/// tools among many plausible distractors.
pub fn big_catalog(n: usize) -> Vec<(String, Doc)> {
    let mut docs = catalog();
    let more = n.saturating_sub(docs.len());
    docs.extend(generated::generated().into_iter().take(more));
    docs
}

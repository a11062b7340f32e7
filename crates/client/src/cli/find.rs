//! `toolctl local find`: the tools this host offers, ranked against a request in plain words.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use toolsrv_find::{Doc, Encoder, Hit, Index, MAX_QUERY_BYTES, VectorStore};
use toolsrv_meta::ResolvedTool;

use super::ToolsArgs;
use super::{exit, local, write_json, written};

/// One line of the result, as `--json` prints it.
#[derive(Debug, Serialize)]
struct Found<'a> {
    name: &'a str,
    /// 0..1, see the toolsrv-find crate: the lexical score without a model, the fused one with.
    score: f32,
    lexical: Option<f32>,
    semantic: Option<f32>,
    description: &'a str,
}

/// Where `local find` keeps the encoder's vectors unless told: `find-vectors` in toolsrv's
/// directory of the user's cache, beside the models `scripts/fetch-find-model` lays out.
pub fn default_vectors_dir() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("toolsrv/find-vectors"))
}

pub fn run(
    tools: &ToolsArgs,
    query: &str,
    limit: usize,
    json: bool,
    model: Option<&Path>,
    vectors: Option<&Path>,
) -> u8 {
    if query.len() > MAX_QUERY_BYTES {
        eprintln!(
            "toolctl: the request is {} bytes; at most {MAX_QUERY_BYTES} are searched",
            query.len()
        );
        return exit::USAGE;
    }
    let encoder = match model.map(Encoder::load).transpose() {
        Ok(encoder) => encoder.map(Arc::new),
        Err(e) => {
            eprintln!("toolctl: --model: {e}");
            return exit::CONFIG;
        }
    };
    let (catalog, host) = match local::load(tools, false) {
        Ok(loaded) => loaded,
        Err(code) => return code,
    };
    // Only what this host offers, as it resolves it: a variant may describe a tool differently.
    let views = toolsrv_host::view(&catalog, &host);
    let visible: Vec<&ResolvedTool> = views.iter().filter_map(|v| v.resolution.tool()).collect();
    let store = match (&encoder, vectors) {
        (Some(encoder), Some(dir)) => match VectorStore::open(dir, encoder) {
            Ok(store) => Some(store),
            Err(e) => {
                eprintln!("toolctl: warning: {e}; every text is embedded again");
                None
            }
        },
        _ => None,
    };
    let mut index = Index::new(encoder);
    if let Some(store) = store {
        index = index.with_store(store);
    }
    let docs = visible.iter().map(|t| (t.name.clone(), doc(t))).collect();
    let hits = match index.update(docs).and_then(|updated| {
        if let Some(problem) = updated.store_problem {
            eprintln!("toolctl: warning: {problem}");
        }
        index.search(query, limit, |_| true)
    }) {
        Ok(hits) => hits,
        Err(e) => {
            eprintln!("toolctl: cannot rank the tools: {e}");
            return exit::INTERNAL;
        }
    };
    let found: Vec<Found<'_>> = hits
        .iter()
        .map(|h: &Hit<String>| Found {
            name: &h.key,
            score: h.score,
            lexical: h.lexical,
            semantic: h.semantic,
            description: visible
                .iter()
                .find(|t| t.name == h.key)
                .and_then(|t| t.description.as_deref())
                .unwrap_or(""),
        })
        .collect();
    let mut out = std::io::stdout().lock();
    let result = if json {
        write_json(&mut out, &found)
    } else {
        write_table(&mut out, &found)
    };
    let code = written(result, "the tools found");
    if code != 0 {
        return code;
    }
    if found.is_empty() {
        if !json {
            eprintln!("toolctl: no tool on this host matches {query:?}");
        }
        return exit::NO_MATCH;
    }
    0
}

fn doc(tool: &ResolvedTool) -> Doc {
    Doc {
        name: tool.name.clone(),
        description: tool.description.clone().unwrap_or_default(),
        prompt: tool.prompt.clone().unwrap_or_default(),
        keywords: tool.keywords.clone(),
    }
}

/// One line per match; a description is shown [`printable`](super::quote::printable), since a
/// tools path can be another user's directory.
fn write_table(out: &mut impl Write, found: &[Found<'_>]) -> std::io::Result<()> {
    let width = found.iter().map(|f| f.name.len()).max().unwrap_or(0);
    for f in found {
        let description = super::quote::printable(f.description);
        writeln!(out, "{:.3}  {:width$}  {description}", f.score, f.name)?;
    }
    Ok(())
}

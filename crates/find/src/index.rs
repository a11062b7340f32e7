//! The index the coordinator keeps per catalog: documents by key, replaced as a whole by
//! `update`, searched without waiting for an update in progress.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use sha2::{Digest, Sha256};

use crate::encoder::Encoder;
use crate::lexical::{self, Lexical};
use crate::semantic::{Correction, DocVectors, Semantic};
use crate::store::{TextHash, VectorStore, Vectors};
use crate::text::Analyzer;
use crate::{Doc, FindError};

/// Longest request searched, in bytes.
pub const MAX_QUERY_BYTES: usize = 4096;

/// How scores are made and which hits are dropped. [`Options::default`] holds the values
/// measured on the evaluation set (`eval/`, see BENCHMARKS.md).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Field weights of the lexical ranker.
    pub lexical: lexical::Params,
    /// Share of the semantic score in the score when an encoder is present; the lexical score
    /// has the rest.
    pub semantic_weight: f32,
    /// Share of a tool's hub score (how close it comes to requests meant for other tools)
    /// subtracted from its semantic score; 0 turns the correction off. See the crate
    /// documentation.
    pub hub_weight: f32,
    /// How many of a tool's best scores against other tools' keyword phrases make its hub
    /// score.
    pub hub_neighbours: usize,
    /// Lowest score returned without an encoder.
    pub min_lexical: f32,
    /// Lowest plain score (see the crate documentation) returned with an encoder.
    pub min_fused: f32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            lexical: lexical::Params::default(),
            semantic_weight: 0.9,
            hub_weight: 0.25,
            hub_neighbours: 50,
            min_lexical: 0.1,
            min_fused: 0.18,
        }
    }
}

/// One ranked document.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit<K> {
    pub key: K,
    /// What the hits are ranked by, in 0..1; see the crate documentation.
    pub score: f32,
    /// The lexical ranker's score, 0..1.
    pub lexical: Option<f32>,
    /// The semantic score the hits are ranked by, about -1..1 (cosine similarities, centred and
    /// less the tool's hub penalty); `None` without an encoder.
    pub semantic: Option<f32>,
    /// What the threshold is held against ([`Options::min_fused`] with an encoder,
    /// [`Options::min_lexical`] without): the score from uncorrected similarities (see the crate
    /// documentation), or the lexical score.
    pub relevance: f32,
}

/// What an [`Index::update`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Updated {
    pub docs: usize,
    /// Texts run through the encoder (new or changed).
    pub embedded: usize,
    /// Texts whose vectors were kept from the previous document set.
    pub reused: usize,
    /// Texts whose vectors were read from the [`VectorStore`] (by this update or, not needed
    /// then, by an earlier one).
    pub stored: usize,
    /// Why the store could not be read or written, when it could not: the update is done all
    /// the same, embedding what it did not find there.
    pub store_problem: Option<String>,
    /// Documents left out because [`Index::update_admitting`]'s `admit` refused to embed their
    /// new texts.
    pub deferred: usize,
}

/// One immutable document set; a search holds an `Arc` of it, so an update never waits for
/// searches and a search sees one set whole.
#[derive(Debug)]
struct Snapshot<K> {
    keys: Vec<K>,
    lexical: Lexical,
    /// The documents' text vectors, the catalog's centring and each document's hub penalty.
    semantic: Semantic,
    /// Vector by text, for the next update to reuse.
    cache: Vectors,
}

impl<K> Default for Snapshot<K> {
    fn default() -> Self {
        Snapshot {
            keys: Vec::new(),
            lexical: Lexical::default(),
            semantic: Semantic::default(),
            cache: Vectors::new(),
        }
    }
}

/// Documents ranked against requests. `Send + Sync` when `K` is: share it in an `Arc`.
#[derive(Debug)]
pub struct Index<K> {
    encoder: Option<Arc<Encoder>>,
    options: Options,
    analyzer: Analyzer,
    current: RwLock<Arc<Snapshot<K>>>,
    /// One update at a time, so two do not both embed the same new texts; with what they keep
    /// from the store.
    updating: Mutex<Kept>,
    store: Option<VectorStore>,
}

/// What updates keep from the [`VectorStore`] between them.
#[derive(Debug)]
struct Kept {
    /// Whether the store is still to be read (the first update reads it).
    unread: bool,
    /// Vectors read from the store that no update has taken yet: after a start, views reach a
    /// coordinator over some seconds, and its first updates hold only part of the catalog (the
    /// very first often none of it). Dropped once an update with documents takes none of them:
    /// what is left is then of texts the catalog no longer has.
    reserve: Vectors,
}

impl<K: Clone> Index<K> {
    /// An empty index; with an encoder it ranks by meaning as well as by words.
    pub fn new(encoder: Option<Arc<Encoder>>) -> Self {
        Self::with_options(encoder, Options::default())
    }

    pub fn with_options(encoder: Option<Arc<Encoder>>, options: Options) -> Self {
        Index {
            encoder,
            options,
            analyzer: Analyzer::default(),
            current: RwLock::new(Arc::new(Snapshot::default())),
            updating: Mutex::new(Kept {
                unread: true,
                reserve: Vectors::new(),
            }),
            store: None,
        }
    }

    /// Keeps the encoder's vectors in `store` as well: the first update takes the vectors it
    /// finds there instead of embedding their texts, and every update that embedded a text
    /// writes the vectors of its document set back. Without an encoder there is nothing to keep.
    pub fn with_store(mut self, store: VectorStore) -> Self {
        if self.encoder.is_some() {
            self.store = Some(store);
        }
        self
    }

    /// Whether searches use the encoder.
    pub fn has_encoder(&self) -> bool {
        self.encoder.is_some()
    }

    fn snapshot(&self) -> Arc<Snapshot<K>> {
        // A panic elsewhere while holding the lock cannot leave the `Arc` half-written.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.snapshot().keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the whole document set. Texts embedded for the previous set are reused, so an
    /// update after one tool changed runs the encoder on that tool's texts only. Searches go on
    /// against the previous set until the new one is swapped in; on error the index is
    /// unchanged.
    pub fn update(&self, docs: Vec<(K, Doc)>) -> Result<Updated, FindError> {
        self.update_admitting(docs, |_, _| true)
    }

    /// As [`Index::update`], asking `admit` before the encoder embeds a document's texts: it is
    /// given the document's key and how many of its texts have no vector yet (it is not asked
    /// about a document whose texts all have one, nor without an encoder), in document order.
    /// A document it refuses is left out of this document set, its texts not embedded, and
    /// counted in [`Updated::deferred`]; a later update may take it. So a caller can bound what
    /// documents from untrusted sources cost the encoder.
    pub fn update_admitting(
        &self,
        docs: Vec<(K, Doc)>,
        mut admit: impl FnMut(&K, usize) -> bool,
    ) -> Result<Updated, FindError> {
        let mut docs: Vec<(K, Doc)> = docs.into_iter().map(|(k, d)| (k, d.bounded())).collect();
        let mut kept = self.updating.lock().unwrap_or_else(PoisonError::into_inner);
        let previous = self.snapshot();
        let mut updated = Updated::default();
        let mut cache = Vectors::new();
        let mut semantic = Semantic::default();
        if let Some(encoder) = &self.encoder {
            if let Some(store) = self.store.as_ref().filter(|_| kept.unread) {
                kept.unread = false;
                match store.read() {
                    Ok(vectors) => kept.reserve = vectors,
                    Err(e) => updated.store_problem = Some(e.to_string()),
                }
            }
            let texts: Vec<Vec<String>> = docs.iter().map(|(_, d)| passages(d)).collect();
            // Each admitted document's text hashes, in order; what the encoder is to embed.
            let mut hashes: Vec<Vec<TextHash>> = Vec::with_capacity(docs.len());
            let mut admitted = Vec::with_capacity(docs.len());
            let mut missing: Vec<(TextHash, &str)> = Vec::new();
            let mut queued = HashSet::new();
            for ((key, _), doc_texts) in docs.iter().zip(&texts) {
                let doc_hashes: Vec<TextHash> = doc_texts.iter().map(|t| hash(t)).collect();
                let new: HashSet<&TextHash> = doc_hashes
                    .iter()
                    .filter(|h| {
                        !(cache.contains_key(*h)
                            || queued.contains(*h)
                            || previous.cache.contains_key(*h)
                            || kept.reserve.contains_key(*h))
                    })
                    .collect();
                let admit_here = new.is_empty() || admit(key, new.len());
                admitted.push(admit_here);
                if !admit_here {
                    updated.deferred += 1;
                    continue;
                }
                for (hash, text) in doc_hashes.iter().zip(doc_texts) {
                    if cache.contains_key(hash) || queued.contains(hash) {
                        continue;
                    }
                    if let Some(v) = previous.cache.get(hash) {
                        cache.insert(*hash, v.clone());
                        updated.reused += 1;
                        continue;
                    }
                    match kept.reserve.get(hash) {
                        Some(v) => {
                            cache.insert(*hash, v.clone());
                            updated.stored += 1;
                        }
                        None => {
                            queued.insert(*hash);
                            missing.push((*hash, text));
                        }
                    }
                }
                hashes.push(doc_hashes);
            }
            if updated.deferred > 0 {
                let mut keep = admitted.into_iter();
                docs.retain(|_| keep.next().unwrap_or(false));
            }
            let fresh = encoder.embed(&missing.iter().map(|(_, t)| *t).collect::<Vec<_>>())?;
            updated.embedded = fresh.len();
            for ((hash, _), v) in missing.iter().zip(fresh) {
                cache.insert(*hash, Arc::from(v));
            }
            let vectors: Vec<DocVectors> = hashes
                .iter()
                .map(|hs| hs.iter().filter_map(|h| cache.get(h).cloned()).collect())
                .collect();
            semantic = Semantic::build(
                &vectors,
                &Correction {
                    hub_weight: self.options.hub_weight,
                    hub_neighbours: self.options.hub_neighbours,
                },
            )?;
            if !docs.is_empty() {
                if updated.stored == 0 {
                    kept.reserve = Vectors::new();
                } else {
                    kept.reserve.retain(|hash, _| !cache.contains_key(hash));
                }
            }
            // Written when it lacks a vector of this set: texts were embedded, or the file
            // could not be read (a bad file is replaced). What the reserve still holds stays in
            // it, for the views still to come.
            if let Some(store) = &self.store
                && (updated.embedded > 0 || updated.store_problem.is_some())
                && let Err(e) = store.write(&[&cache, &kept.reserve])
            {
                updated.store_problem = Some(match updated.store_problem.take() {
                    Some(read) => format!("{read}; {e}"),
                    None => e.to_string(),
                });
            }
        }
        updated.docs = docs.len();
        let refs: Vec<&Doc> = docs.iter().map(|(_, d)| d).collect();
        let lexical = Lexical::build(&self.analyzer, &refs, &self.options.lexical);
        let next = Snapshot {
            keys: docs.into_iter().map(|(k, _)| k).collect(),
            lexical,
            semantic,
            cache,
        };
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next);
        Ok(updated)
    }

    /// The documents `filter` admits, best first, at most `limit`, none scoring under the
    /// threshold (see the crate documentation). A request with no letters or digits matches
    /// nothing.
    pub fn search(
        &self,
        query: &str,
        limit: usize,
        filter: impl Fn(&K) -> bool,
    ) -> Result<Vec<Hit<K>>, FindError> {
        if query.len() > MAX_QUERY_BYTES {
            return Err(FindError::QueryTooLong {
                len: query.len(),
                max: MAX_QUERY_BYTES,
            });
        }
        if limit == 0 || !query.chars().any(char::is_alphanumeric) {
            return Ok(Vec::new());
        }
        let snapshot = self.snapshot();
        let lexical = snapshot.lexical.scores(&self.analyzer.terms(query));
        let semantic = match &self.encoder {
            Some(encoder) if !snapshot.keys.is_empty() => encoder
                .embed(&[query])?
                .into_iter()
                .next()
                .map(|plain| snapshot.semantic.scores(&plain)),
            _ => None,
        };
        let w = self.options.semantic_weight;
        let mut hits: Vec<Hit<K>> = Vec::new();
        for (i, key) in snapshot.keys.iter().enumerate() {
            if !filter(key) {
                continue;
            }
            let lex = lexical[i];
            let fuse = |sem: f32| w * sem.max(0.0) + (1.0 - w) * lex;
            // The score ranks; `relevance` decides whether the hit is returned at all.
            let (score, relevance, min, semantic) = match &semantic {
                Some(scores) => {
                    let s = scores[i];
                    (
                        fuse(s.ranked),
                        fuse(s.plain),
                        self.options.min_fused,
                        Some(s.ranked),
                    )
                }
                None => (lex, lex, self.options.min_lexical, None),
            };
            if score > 0.0 && relevance >= min {
                hits.push(Hit {
                    key: key.clone(),
                    score,
                    lexical: Some(lex),
                    semantic,
                    relevance,
                });
            }
        }
        // Ties keep document order, so a search is deterministic.
        hits.sort_by(|a, b| b.score.total_cmp(&a.score));
        hits.truncate(limit);
        Ok(hits)
    }
}

/// The texts of a document the encoder sees, each embedded on its own: first a summary (name,
/// description, the prompt's first paragraph, keywords), then each keyword phrase alone. A
/// keyword is a short request in users' words, and a short request is closest to another short
/// one: measured on the evaluation set, half the summary plus half the best keyword finds more
/// paraphrased requests (recall@3 0.76) than the summary alone (0.61), the summary and the
/// whole prompt (0.58) or the best of all texts (0.70).
///
/// At most [`MAX_KEYWORD_PASSAGES`] keyword phrases are embedded on their own (the first ones):
/// each costs an encoder pass, and a tool's author (or a compromised host offering a tool of its
/// own) could otherwise list ten thousand of them in one `.meta` and keep the encoder busy for
/// minutes on every index build. The rest still count in the summary and for the words.
fn passages(doc: &Doc) -> Vec<String> {
    let name = doc.name.replace(['_', '-'], " ");
    let first_paragraph = doc
        .prompt
        .split("\n\n")
        .map(str::trim)
        .find(|p| !p.is_empty() && !p.starts_with('#'))
        .unwrap_or("");
    let mut texts = vec![format!(
        "{name}: {} {first_paragraph}. {}",
        doc.description,
        doc.keywords.join(", ")
    )];
    texts.extend(
        doc.keywords
            .iter()
            .filter(|k| !k.trim().is_empty())
            .take(MAX_KEYWORD_PASSAGES)
            .cloned(),
    );
    texts
}

/// Most keyword phrases of one tool embedded on their own (see [`passages`]); real tools list
/// under a dozen.
pub const MAX_KEYWORD_PASSAGES: usize = 32;

fn hash(text: &str) -> TextHash {
    Sha256::digest(text.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(name: &str, description: &str) -> Doc {
        Doc {
            name: name.into(),
            description: description.into(),
            ..Doc::default()
        }
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn ten_thousand_keywords_cost_at_most_a_bounded_number_of_encoder_passes() {
        let mut flood = doc("flood", "Many keywords");
        flood.keywords = (0..10_000).map(|i| format!("phrase {i}")).collect();
        flood.keywords.insert(3, "  ".into());
        let texts = passages(&flood);
        assert_eq!(texts.len(), 1 + MAX_KEYWORD_PASSAGES);
        assert_eq!(texts[1], "phrase 0");
        assert_eq!(
            texts[MAX_KEYWORD_PASSAGES],
            format!("phrase {}", MAX_KEYWORD_PASSAGES - 1)
        );
        // Words find the tool by a keyword in the first 16 KiB of them, not by one past it.
        let index = Index::new(None);
        index
            .update(vec![
                ("flood".to_string(), flood),
                ("other".to_string(), doc("other", "Something else")),
            ])
            .unwrap();
        let hits = index.search("phrase 1200", 5, |_| true).unwrap();
        assert_eq!(hits.first().map(|h| h.key.as_str()), Some("flood"));
        let hits = index.search("9999", 5, |_| true).unwrap();
        assert!(hits.is_empty(), "{:?}", hits.first().map(|h| &h.key));
    }

    /// Of a tool's description and prompt, the index reads the first 16 KiB: a word past it
    /// does not find the tool, one before it does, and the index holds no more of it.
    #[test]
    fn the_index_reads_the_start_of_each_text() {
        let mut long = doc("long", "Rotates the fizzbuzz logs");
        long.prompt = format!("{} quuxword", "filler ".repeat(40_000));
        long.description.push_str(&" padding".repeat(40_000));
        let bounded = long.clone().bounded();
        assert_eq!(bounded.prompt.len(), crate::MAX_INDEXED_BYTES);
        assert!(bounded.description.len() <= crate::MAX_INDEXED_BYTES);
        let index = Index::new(None);
        index.update(vec![("long".to_string(), long)]).unwrap();
        let hits = index.search("fizzbuzz", 5, |_| true).unwrap();
        assert_eq!(hits.first().map(|h| h.key.as_str()), Some("long"));
        assert!(index.search("quuxword", 5, |_| true).unwrap().is_empty());
        // Cut on a character boundary.
        let wide = Doc {
            prompt: "é".repeat(20_000),
            ..doc("wide", "x")
        }
        .bounded();
        assert!(wide.prompt.len() <= crate::MAX_INDEXED_BYTES && wide.prompt.ends_with('é'));
    }

    #[test]
    fn index_is_send_and_sync() {
        assert_send_sync::<Index<String>>();
    }

    #[test]
    fn search_ranks_filters_and_drops_non_matches() {
        let index = Index::new(None);
        index
            .update(vec![
                (
                    "disk_usage".to_string(),
                    doc("disk_usage", "Free space on a disk"),
                ),
                (
                    "kill_process".to_string(),
                    doc("kill_process", "Stop a process"),
                ),
            ])
            .unwrap();
        let hits = index.search("disk space", 5, |_| true).unwrap();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].key, "disk_usage");
        assert!(hits[0].semantic.is_none());
        assert!(
            index
                .search("disk space", 5, |k| k != "disk_usage")
                .unwrap()
                .is_empty()
        );
        assert!(index.search("bake a cake", 5, |_| true).unwrap().is_empty());
        assert!(index.search("", 5, |_| true).unwrap().is_empty());
        assert!(index.search("disk", 0, |_| true).unwrap().is_empty());
        assert!(matches!(
            index.search(&"a".repeat(MAX_QUERY_BYTES + 1), 5, |_| true),
            Err(FindError::QueryTooLong { .. })
        ));
    }
}

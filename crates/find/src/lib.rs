//! Ranks tools against a plain-language request ("how hot is this machine running") from their
//! `description`, `prompt` and `keywords`, so that a model or an operator finds the tool to call
//! among hundreds.
//!
//! Two rankers:
//!
//! - **lexical**, always on: BM25F over the tool's name (`restart_service` counts as "restart
//!   service"), description, keywords and prompt, with English stemming and stop words dropped.
//!   It finds a tool when the request shares words with its texts.
//! - **semantic**, when an [`Encoder`] is given: a sentence encoder run locally (no network),
//!   all-MiniLM-L6-v2 or the larger all-mpnet-base-v2, which also finds a tool when the request
//!   says the same thing in other words ("put process 4412 out of its misery"). Each of a tool's
//!   texts is embedded once, when it enters the index.
//!
//! # Score
//!
//! Every hit has a `score` in 0..1, higher is better:
//!
//! - without an encoder it is the lexical score: the IDF-weighted share of the request's words
//!   (after stemming, stop words aside) that the tool's texts contain, each word's share growing
//!   with how often and in which field it occurs (name and description count most, the prompt
//!   least) and saturating as in BM25. A word no tool uses counts against every tool.
//! - with an encoder it is `0.9 × semantic + 0.1 × lexical` (negative `semantic` counted as
//!   0). `semantic` starts as half the cosine similarity between the request and a summary of
//!   the tool (name, description, first paragraph of the prompt, keywords) plus half the
//!   similarity to its closest keyword phrase, with two corrections made per catalog:
//!   every vector is first centred on the mean of the catalog's keyword phrases (what all the
//!   texts of a domain share says nothing about which tool is meant), and a quarter of the
//!   tool's *hub score* is subtracted — the mean of its 50 best scores against the other tools'
//!   keyword phrases taken as requests, which is high for a tool whose texts are generic
//!   enough to come near any request. On the evaluation set, when they were introduced, these
//!   corrections moved the right tool into the top 3 for 0.79 of the strict paraphrases against
//!   56 tools (0.76 without) and 0.63 against 1,000 (0.43 without); BENCHMARKS.md "find" has
//!   the current figures for each encoder.
//!
//! Whether a hit is returned at all is decided on its *plain* score, the same weighting of the
//! uncorrected similarity: the corrections say which tool is closer, not whether any is close.
//! Hits under the threshold are not returned: a score of 0.1 without an encoder (a tool must
//! share a distinctive word with the request), a plain score of 0.18 with one ([`Options`]).
//! That threshold trades: on the evaluation set (all-MiniLM-L6-v2) it keeps the right tool in
//! the top 3 for 0.78 of the requests that share no keyword with it (0.81 with no threshold) and
//! lets a weak hit through for 2 of 6 requests about nothing; 0.22 drops all of those but keeps
//! only 0.68 of the paraphrases. The
//! encoder's similarities do not separate a request about nothing from a loose paraphrase.
//! A request that matches nothing gives an empty result, as does one with no letters or
//! digits. Both components are also reported on each [`Hit`].

mod bert;
mod encoder;
mod error;
mod index;
mod int8;
pub mod lexical;
mod mpnet;
mod semantic;
mod store;
mod text;
mod transformer;

pub use encoder::{Encoder, MODEL_FILES, VECTORS_REVISION};
pub use error::FindError;
pub use index::{Hit, Index, MAX_KEYWORD_PASSAGES, MAX_QUERY_BYTES, Options, Updated};
pub use store::VectorStore;
pub use text::Analyzer;

/// The texts of one tool that are searched, as a host resolves its definition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Doc {
    pub name: String,
    pub description: String,
    pub prompt: String,
    pub keywords: Vec<String>,
}

/// Most bytes of a tool's description, of its prompt, and of its keywords together, that the
/// index reads. Ranking needs the start of each text, not 250 KB of it; and what a host writes
/// of its own tools is indexed again on each change of its view (256 tools of 250 KB each cost
/// a rebuild a minute of a core and a gigabyte).
pub const MAX_INDEXED_BYTES: usize = 16 << 10;

impl Doc {
    /// This document as the index reads it: each text cut to [`MAX_INDEXED_BYTES`] (on a
    /// character boundary), the keywords after the first that pass it left out.
    pub fn bounded(mut self) -> Self {
        fn cut(text: &mut String) {
            text.truncate(text.floor_char_boundary(MAX_INDEXED_BYTES));
        }
        cut(&mut self.description);
        cut(&mut self.prompt);
        let mut total = 0;
        self.keywords.retain_mut(|k| {
            if total >= MAX_INDEXED_BYTES {
                return false;
            }
            cut(k);
            total += k.len();
            true
        });
        self
    }
}

//! Ranks tools against a plain-language request ("how hot is this machine running") from their
//! `description`, `prompt` and `keywords`, so that a model or an operator finds the tool to call
//! among hundreds.
//!
//! Two rankers:
//!
//! - **lexical**, always on: BM25F over the tool's name (`restart_service` counts as "restart
//!   service"), description, keywords and prompt, with English stemming and stop words dropped.
//!   It finds a tool when the request shares words with its texts.
//! - **semantic**, when an [`Encoder`] is given: all-MiniLM-L6-v2 run locally (no network), which
//!   also finds a tool when the request says the same thing in other words ("put process 4412
//!   out of its misery"). Each of a tool's texts is embedded once, when it enters the index.
//!
//! # Score
//!
//! Every hit has a `score` in 0..1, higher is better:
//!
//! - without an encoder it is the lexical score: the IDF-weighted share of the request's words
//!   (after stemming, stop words aside) that the tool's texts contain, each word's share growing
//!   with how often and in which field it occurs (name and description count most, the prompt
//!   least) and saturating as in BM25. A word no tool uses counts against every tool.
//! - with an encoder it is `0.8 × semantic + 0.2 × lexical`, where `semantic` (negative counted
//!   as 0) is half the cosine similarity between the request and a summary of the tool (name,
//!   description, first paragraph of the prompt, keywords) plus half the similarity to its
//!   closest keyword phrase. On the evaluation set, the best tool for a request about something
//!   no tool does scores 0.11 to 0.19, while the right tool for a paraphrased request often
//!   scores no higher: the encoder's similarities are not calibrated enough to tell them apart.
//!
//! Hits scoring under the threshold are not returned: 0.1 without an encoder (a tool must
//! share a distinctive word with the request), 0.16 with one ([`Options`]). That threshold
//! trades: on the evaluation set it keeps the right tool in the top 3 for 0.72 of the
//! paraphrased requests (0.75 with no threshold) and lets a weak hit through for 2 of 6
//! requests about nothing; 0.20 drops all of those but keeps only 0.54 of the paraphrases.
//! A request that matches nothing gives an empty result, as does one with no letters or
//! digits. Both components are also reported on each [`Hit`].

mod encoder;
mod error;
mod index;
pub mod lexical;
mod text;

pub use encoder::{Encoder, MODEL_FILES};
pub use error::FindError;
pub use index::{Hit, Index, MAX_QUERY_BYTES, Options, Updated};
pub use text::Analyzer;

/// The texts of one tool that are searched, as a host resolves its definition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Doc {
    pub name: String,
    pub description: String,
    pub prompt: String,
    pub keywords: Vec<String>,
}

//! The one error type of the crate: a model directory that cannot be used, an input refused,
//! or an encoder that failed on a text.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error(
        "model directory {dir} does not exist or is not a directory (scripts/fetch-find-model \
         DIR lays out a model there)"
    )]
    ModelDir { dir: PathBuf },
    #[error(
        "model directory {dir} has no {file} (scripts/fetch-find-model DIR lays out \
         model.safetensors, tokenizer.json and config.json)"
    )]
    ModelFileMissing { dir: PathBuf, file: &'static str },
    #[error("model directory {dir}: cannot use {file}: {reason}")]
    ModelFile {
        dir: PathBuf,
        file: &'static str,
        reason: String,
    },
    #[error("the request is {len} bytes; at most {max} are searched")]
    QueryTooLong { len: usize, max: usize },
    #[error("vector store {path}: {reason}")]
    Store { path: PathBuf, reason: String },
    #[error("the encoder failed: {0}")]
    Encode(String),
}

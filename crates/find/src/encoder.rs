//! The sentence encoder: all-MiniLM-L6-v2 (a 6-layer BERT) or another sentence-transformers model
//! of the BERT or MPNet architecture (all-mpnet-base-v2) from a local directory, run on the CPU
//! with candle (dense layers on 8-bit weights); a text becomes the mean of its token vectors,
//! scaled to unit length.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use sha2::Digest;
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

use crate::FindError;
use crate::bert::{self, BertModel};
use crate::mpnet::{self, MpNetModel};
use crate::transformer::Sizes;

/// What the vectors of a given model depend on in this code besides the model's files (the
/// integer products, the padding of narrow layers, the pooling): raise it with any change that
/// alters them, so that vectors kept by an earlier build ([`crate::VectorStore`]) are not mixed
/// with new ones.
pub const VECTORS_REVISION: u32 = 1;

/// The files [`Encoder::load`] reads from its directory.
pub const MODEL_FILES: [&str; 3] = ["model.safetensors", "tokenizer.json", "config.json"];

/// Longest input in tokens; the rest of a text is not read. The model was trained on at most
/// 256 (`max_seq_length` of its sentence-transformers configuration).
const MAX_TOKENS: usize = 256;

/// Texts encoded in one forward pass when building an index: big enough to keep the matrix
/// products busy, small enough that padding to the longest text of a batch wastes little
/// (texts are sorted by length first).
const BATCH: usize = 16;

/// The network under the pooling, by `model_type` in `config.json`.
enum Model {
    Bert(BertModel),
    MpNet(MpNetModel),
}

/// A model's settings, by the `model_type` of its `config.json` (BERT when it has none).
enum Architecture {
    Bert(bert::Config),
    MpNet(mpnet::Config),
}

impl Architecture {
    fn of(config: &str) -> Result<Architecture, String> {
        #[derive(serde::Deserialize)]
        struct Kind {
            model_type: Option<String>,
        }
        let kind: Kind = serde_json::from_str(config).map_err(|e| e.to_string())?;
        // The error names the field: "hidden_size: invalid value...".
        fn parse<'a, T: serde::Deserialize<'a>>(config: &'a str) -> Result<T, String> {
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(config))
                .map_err(|e| e.to_string())
        }
        let known = matches!(kind.model_type.as_deref(), Some("bert" | "mpnet") | None);
        if !known {
            return Err(format!(
                "model_type {:?} is not one this encoder runs (bert, mpnet)",
                kind.model_type.unwrap_or_default()
            ));
        }
        // The sizes first, alone: flattened into a configuration, their errors lose the name.
        let sizes: Sizes = parse(config)?;
        let (hidden, heads) = (sizes.hidden_size, sizes.num_attention_heads);
        let architecture = if kind.model_type.as_deref() == Some("mpnet") {
            Architecture::MpNet(parse(config)?)
        } else {
            Architecture::Bert(parse(config)?)
        };
        if heads == 0 || hidden % heads != 0 {
            return Err(format!(
                "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            ));
        }
        Ok(architecture)
    }

    /// The most tokens the model's position embeddings cover, capped at [`MAX_TOKENS`].
    fn max_tokens(&self) -> usize {
        let positions = match self {
            Architecture::Bert(c) => c.sizes.max_position_embeddings,
            // Positions start after the pad id.
            Architecture::MpNet(c) => c
                .sizes
                .max_position_embeddings
                .saturating_sub(c.pad_token_id as usize + 1),
        };
        positions.min(MAX_TOKENS)
    }

    fn sizes(&self) -> &Sizes {
        match self {
            Architecture::Bert(c) => &c.sizes,
            Architecture::MpNet(c) => &c.sizes,
        }
    }
}

/// A loaded sentence encoder. Cheap to share (`Arc`); encoding takes `&self`.
pub struct Encoder {
    model: Model,
    tokenizer: Tokenizer,
    /// The threads a forward pass splits its large products over ([`crate::int8`]). The pass
    /// itself runs on one of them: its idle threads wait (spinning briefly) while it does the
    /// small steps, so on a machine with as many threads as cores nothing else competes with
    /// the pass for a core. Run from the caller's thread, the pass shared the cores with the
    /// pool's spinning threads and took twice as long (BENCHMARKS.md "find").
    pool: rayon::ThreadPool,
    device: Device,
    dir: PathBuf,
    dims: usize,
    /// See [`fingerprint`](Self::fingerprint).
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("dir", &self.dir)
            .field("dims", &self.dims)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// Loads the model from `dir`, which must hold [`MODEL_FILES`] (as `scripts/fetch-find-model`
    /// lays them out). Reads nothing from the network.
    pub fn load(dir: &Path) -> Result<Encoder, FindError> {
        Self::check_dir(dir)?;
        let bad = |file: &'static str| {
            let dir = dir.to_path_buf();
            move |e: &dyn std::fmt::Display| FindError::ModelFile {
                dir,
                file,
                reason: e.to_string(),
            }
        };
        let config_text =
            std::fs::read_to_string(dir.join("config.json")).map_err(|e| bad("config.json")(&e))?;
        let architecture = Architecture::of(&config_text).map_err(|e| bad("config.json")(&e))?;
        let tokenizer_bytes =
            std::fs::read(dir.join("tokenizer.json")).map_err(|e| bad("tokenizer.json")(&e))?;
        let mut tokenizer =
            Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| bad("tokenizer.json")(&e))?;
        // A tokenizer of another model gives ids the embeddings do not have: refused here,
        // naming both files, rather than on the first request that uses such a word.
        let vocab = architecture.sizes().vocab_size;
        if let Some(id) = tokenizer.get_vocab(true).into_values().max()
            && id as usize >= vocab
        {
            return Err(bad("tokenizer.json")(&format!(
                "it has token id {id}, and config.json's vocab_size is {vocab}: the tokenizer is \
                 not this model's"
            )));
        }
        // The file pads every input to 128 tokens and cuts at 128: pad a batch only to its
        // longest text instead, and cut where the model was trained to.
        let max_length = architecture.max_tokens();
        if max_length < 2 {
            return Err(bad("config.json")(
                &"max_position_embeddings leaves no room for a token",
            ));
        }
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length,
                ..Default::default()
            }))
            .map_err(|e| bad("tokenizer.json")(&e))?;
        // The file's pad token stays (MPNet pads with id 1, BERT with 0).
        let padding = tokenizer.get_padding().cloned().unwrap_or_default();
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..padding
        }));
        let device = Device::Cpu;
        let weights = std::fs::read(dir.join("model.safetensors"))
            .map_err(|e| bad("model.safetensors")(&e))?;
        let fingerprint = fingerprint(&[config_text.as_bytes(), &tokenizer_bytes, &weights]);
        drop(tokenizer_bytes);
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &device)
            .map_err(|e| bad("model.safetensors")(&candle_words(&e)))?;
        let (model, dims) = match architecture {
            Architecture::Bert(config) => (
                Model::Bert(
                    BertModel::load(vb, &config)
                        .map_err(|e| bad("model.safetensors")(&candle_words(&e)))?,
                ),
                config.sizes.hidden_size,
            ),
            Architecture::MpNet(config) => (
                Model::MpNet(
                    MpNetModel::load(vb, &config)
                        .map_err(|e| bad("model.safetensors")(&candle_words(&e)))?,
                ),
                config.sizes.hidden_size,
            ),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("find-encoder-{i}"))
            .build()
            .map_err(|e| FindError::Encode(format!("starting the encoder's threads: {e}")))?;
        let encoder = Encoder {
            model,
            tokenizer,
            pool,
            device,
            dir: dir.to_path_buf(),
            dims,
            fingerprint,
        };
        // A model that loads but cannot run (wrong shapes) fails here, naming the directory,
        // rather than on the first search.
        encoder
            .embed(&["probe"])
            .map_err(|e| bad("model.safetensors")(&e))?;
        Ok(encoder)
    }

    /// What [`load`](Self::load) checks first, without reading a file: that `dir` is a directory
    /// holding [`MODEL_FILES`]. For a program that starts other work alongside the load and
    /// should fail before it does.
    pub fn check_dir(dir: &Path) -> Result<(), FindError> {
        if !dir.is_dir() {
            return Err(FindError::ModelDir {
                dir: dir.to_path_buf(),
            });
        }
        for file in MODEL_FILES {
            if !dir.join(file).is_file() {
                return Err(FindError::ModelFileMissing {
                    dir: dir.to_path_buf(),
                    file,
                });
            }
        }
        Ok(())
    }

    /// The directory the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A digest of what this encoder's vectors depend on: the model's three files and the
    /// revision of the arithmetic here. Two encoders with the same fingerprint give the same
    /// vector for a text (to rounding, on CPUs of another kind).
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Length of every vector [`embed`](Self::embed) returns.
    pub fn dims(&self) -> usize {
        self.dims
    }

    /// One unit-length vector per text, in order.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, FindError> {
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| texts[i].len());
        let mut out = vec![Vec::new(); texts.len()];
        for chunk in order.chunks(BATCH) {
            let batch: Vec<&str> = chunk.iter().map(|&i| texts[i]).collect();
            for (&i, v) in chunk.iter().zip(self.embed_batch(&batch)?) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, FindError> {
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| FindError::Encode(e.to_string()))?;
        let ids: Vec<Tensor> = encodings
            .iter()
            .map(|e| Tensor::new(e.get_ids(), &self.device))
            .collect::<candle_core::Result<_>>()?;
        let masks: Vec<Tensor> = encodings
            .iter()
            .map(|e| Tensor::new(e.get_attention_mask(), &self.device))
            .collect::<candle_core::Result<_>>()?;
        let ids = Tensor::stack(&ids, 0)?;
        let mask = Tensor::stack(&masks, 0)?;
        let hidden = self.pool.install(|| match &self.model {
            Model::Bert(model) => model.forward(&ids, &mask),
            Model::MpNet(model) => model.forward(&ids, &mask),
        })?;
        // Mean over the real tokens only: padding must not pull short texts towards each other.
        let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        let counts = mask.sum(1)?.clamp(1.0, f64::MAX)?;
        let mean = summed.broadcast_div(&counts)?;
        let norms = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
        let unit = mean.broadcast_div(&norms)?;
        Ok(unit.to_vec2::<f32>()?)
    }
}

/// The SHA-256 of [`VECTORS_REVISION`] and `files`, each preceded by its length.
fn fingerprint(files: &[&[u8]]) -> [u8; 32] {
    let mut digest = sha2::Sha256::new();
    digest.update(VECTORS_REVISION.to_le_bytes());
    for file in files {
        digest.update((file.len() as u64).to_le_bytes());
        digest.update(file);
    }
    digest.finalize().into()
}

/// Dot product of two vectors (of unit vectors: their cosine similarity), in f32, for the few
/// products made outside the 8-bit matrix (the centre's, a request's). Summed in 8 independent
/// lanes: a single running sum must add in order, which keeps the compiler from using SIMD.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let (a, b) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a
        .remainder()
        .iter()
        .zip(b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    let mut lanes = [0.0f32; LANES];
    for (x, y) in a.zip(b) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

impl From<candle_core::Error> for FindError {
    fn from(e: candle_core::Error) -> Self {
        FindError::Encode(candle_words(&e))
    }
}

/// A candle error in its own words, without the backtrace candle adds to them (over dozens of
/// lines) when `RUST_BACKTRACE` is set: a message for whoever gave the model directory.
fn candle_words(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_words(inner),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", candle_words(inner))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_candle_error_is_told_without_its_backtrace() {
        let shape = || Box::new(candle_core::Error::Msg("shape mismatch for x".into()));
        let traced = candle_core::Error::WithBacktrace {
            inner: shape(),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        assert!(traced.to_string().lines().count() > 1, "{traced}");
        assert_eq!(candle_words(&traced), "shape mismatch for x");
        let within = candle_core::Error::Context {
            inner: Box::new(traced),
            context: Box::new("loading layer 3"),
        };
        assert_eq!(
            candle_words(&within),
            "loading layer 3: shape mismatch for x"
        );
    }
}

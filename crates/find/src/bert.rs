//! BERT (the architecture of all-MiniLM-L6-v2) with its dense layers run on 8-bit weights (see
//! [`crate::transformer::Linear`]): words, absolute positions and the first token type are
//! embedded, summed and normalised, then run through the layers.

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder, layer_norm};
use serde::Deserialize;

use crate::transformer::{Layer, Names, Sizes, layers, padding_bias, word_and_position_embeddings};

/// Where a BERT layer's weights are.
const NAMES: Names = Names {
    query: "attention.self.query",
    key: "attention.self.key",
    value: "attention.self.value",
    attention_out: "attention.output.dense",
    attention_norm: "attention.output.LayerNorm",
};

/// The fields of a Hugging Face `config.json` with `"model_type": "bert"` that the model reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(flatten)]
    pub sizes: Sizes,
    #[serde(default = "default_types")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Read only to refuse a model with positions of another kind, naming the kind.
    #[serde(default = "default_positions", rename = "position_embedding_type")]
    _positions: Positions,
}

/// How token positions are told to the model: only learned absolute positions are run here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Positions {
    Absolute,
}

fn default_types() -> usize {
    2
}

fn default_eps() -> f64 {
    1e-12
}

fn default_positions() -> Positions {
    Positions::Absolute
}

/// The BERT encoder: token ids in, one hidden vector per token out.
pub struct BertModel {
    words: Embedding,
    positions: Embedding,
    /// The embedding of token type 0, the only one a single sentence has; `None` for a model
    /// without token types.
    token_type: Option<Tensor>,
    norm: LayerNorm,
    layers: Vec<Layer>,
}

impl BertModel {
    /// Loads the weights, named as in the reference (`embeddings...`, `encoder.layer.N...`),
    /// with or without a leading `bert.`.
    pub fn load(vb: VarBuilder, c: &Config) -> Result<BertModel> {
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight") {
            vb
        } else {
            vb.pp("bert")
        };
        let e = vb.pp("embeddings");
        let sizes = &c.sizes;
        let (words, positions) = word_and_position_embeddings(sizes, e.clone())?;
        let token_type = if c.type_vocab_size > 0 {
            let types = e.get(
                (c.type_vocab_size, sizes.hidden_size),
                "token_type_embeddings.weight",
            )?;
            Some(types.get(0)?)
        } else {
            None
        };
        Ok(BertModel {
            words,
            positions,
            token_type,
            norm: layer_norm(sizes.hidden_size, c.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: layers(sizes, c.layer_norm_eps, vb, &NAMES)?,
        })
    }

    /// `ids` and `mask`: (batch, len), `mask` 1 for real tokens and 0 for padding. `len` must
    /// not exceed `max_position_embeddings` (the encoder truncates to it).
    pub fn forward(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (_, len) = ids.dims2()?;
        let positions = Tensor::arange(0u32, len as u32, ids.device())?;
        let mut x = self
            .words
            .forward(ids)?
            .broadcast_add(&self.positions.forward(&positions)?)?;
        if let Some(token_type) = &self.token_type {
            x = x.broadcast_add(token_type)?;
        }
        let mut x = self.norm.forward(&x)?;
        let bias = padding_bias(mask)?;
        for layer in &self.layers {
            x = layer.forward(&x, &bias)?;
        }
        Ok(x)
    }
}

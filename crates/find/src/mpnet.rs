//! MPNet (the architecture of all-mpnet-base-v2) on candle, which ships BERT but not MPNet. It is
//! BERT without token types and with a learned bias per attention head for each bucket of
//! relative distance between two tokens, shared by every layer. Its dense layers run with 8-bit
//! weights (see [`crate::transformer::Linear`]).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder, embedding, layer_norm};
use serde::Deserialize;

use crate::transformer::{Layer, Names, Sizes, layers, padding_bias, word_and_position_embeddings};

/// Where an MPNet layer's weights are.
const NAMES: Names = Names {
    query: "attention.attn.q",
    key: "attention.attn.k",
    value: "attention.attn.v",
    attention_out: "attention.attn.o",
    attention_norm: "attention.LayerNorm",
};

/// The fields of a Hugging Face `config.json` with `"model_type": "mpnet"` that the model reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(flatten)]
    pub sizes: Sizes,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "default_pad")]
    pub pad_token_id: u32,
}

fn default_eps() -> f64 {
    1e-5
}

fn default_buckets() -> usize {
    32
}

fn default_pad() -> u32 {
    1
}

/// Distances beyond this share the last bucket.
const MAX_DISTANCE: f32 = 128.0;

/// The bucket of a relative position `memory - context`: half the buckets for each direction,
/// the first half of those exact distances, the rest logarithmically wider up to
/// [`MAX_DISTANCE`].
fn bucket(relative: i64, buckets: usize) -> u32 {
    let half = (buckets / 2) as i64;
    let n = -relative;
    let mut ret = if n < 0 { half } else { 0 };
    let n = n.abs();
    let exact = half / 2;
    ret += if n < exact {
        n
    } else {
        // In f32, as the reference computes it: at exact powers of two the rounding decides.
        let scaled = ((n as f32 / exact as f32).ln() / (MAX_DISTANCE / exact as f32).ln()
            * (half - exact) as f32) as i64;
        (exact + scaled).min(half - 1)
    };
    ret as u32
}

/// The MPNet encoder: token ids in, one hidden vector per token out.
pub struct MpNetModel {
    words: Embedding,
    positions: Embedding,
    norm: LayerNorm,
    layers: Vec<Layer>,
    relative_bias: Embedding,
    buckets: usize,
    pad: u32,
    max_positions: usize,
}

impl MpNetModel {
    pub fn load(vb: VarBuilder, c: &Config) -> Result<MpNetModel> {
        let e = vb.pp("embeddings");
        let sizes = &c.sizes;
        let (words, positions) = word_and_position_embeddings(sizes, e.clone())?;
        Ok(MpNetModel {
            words,
            positions,
            norm: layer_norm(sizes.hidden_size, c.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: layers(sizes, c.layer_norm_eps, vb.clone(), &NAMES)?,
            relative_bias: embedding(
                c.relative_attention_num_buckets,
                sizes.num_attention_heads,
                vb.pp("encoder.relative_attention_bias"),
            )?,
            buckets: c.relative_attention_num_buckets,
            pad: c.pad_token_id,
            max_positions: sizes.max_position_embeddings,
        })
    }

    /// `ids` and `mask`: (batch, len), `mask` 1 for real tokens and 0 for padding.
    pub fn forward(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, len) = ids.dims2()?;
        // Positions count real tokens from pad + 1, padding sits at the pad position.
        let rows = ids.to_vec2::<u32>()?;
        let mut positions = Vec::with_capacity(b * len);
        for row in &rows {
            let mut seen = 0u32;
            for &id in row {
                if id == self.pad {
                    positions.push(self.pad);
                } else {
                    seen += 1;
                    positions.push((self.pad + seen).min(self.max_positions as u32 - 1));
                }
            }
        }
        let positions = Tensor::from_vec(positions, (b, len), ids.device())?;
        let x = (self.words.forward(ids)? + self.positions.forward(&positions)?)?;
        let mut x = self.norm.forward(&x)?;

        let mut buckets = Vec::with_capacity(len * len);
        for context in 0..len as i64 {
            for memory in 0..len as i64 {
                buckets.push(bucket(memory - context, self.buckets));
            }
        }
        let buckets = Tensor::from_vec(buckets, (len, len), ids.device())?;
        let relative = self
            .relative_bias
            .forward(&buckets)? // (len, len, heads)
            .permute((2, 0, 1))?
            .unsqueeze(0)?;
        let bias = relative.broadcast_add(&padding_bias(mask)?)?.contiguous()?;
        for layer in &self.layers {
            x = layer.forward(&x, &bias)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_match_the_reference_layout() {
        // Values from the reference implementation's relative_position_bucket(n, 32, 128).
        let cases = [
            (0, 0),
            (-1, 1),
            (-7, 7),
            (-8, 8),
            (-15, 9),
            (-16, 10),
            (-32, 12),
            (-64, 14),
            (-127, 15),
            (-500, 15),
            (1, 17),
            (7, 23),
            (8, 24),
            (16, 26),
            (32, 28),
            (64, 30),
            (500, 31),
        ];
        for (relative, want) in cases {
            assert_eq!(bucket(relative, 32), want, "relative position {relative}");
        }
    }
}

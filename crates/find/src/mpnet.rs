//! MPNet (the architecture of all-mpnet-base-v2) on candle, which ships BERT but not MPNet. It is
//! BERT without token types and with a learned bias per attention head for each bucket of
//! relative distance between two tokens, shared by every layer. Its dense layers run with 8-bit
//! weights (see [`Linear`]).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder, embedding, layer_norm};
use serde::Deserialize;

/// A dense layer with its weights quantized to 8 bits (blocks of 32 weights sharing one f16
/// scale: 8.5 bits a weight instead of 32), its bias kept in f32. Measured on the evaluation set
/// (BENCHMARKS.md "find"): encoding a request 3.2 times as fast as in f32 (26 ms against 84 ms
/// median on two cores), and the same tools found but one request.
struct Linear {
    weight: QMatMul,
    bias: Tensor,
}

fn linear(input: usize, output: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get((output, input), "weight")?;
    Ok(Linear {
        weight: QMatMul::from_qtensor(QTensor::quantize(&weight, GgmlDType::Q8_0)?)?,
        bias: vb.get(output, "bias")?,
    })
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.weight.forward(x)?.broadcast_add(&self.bias)
    }
}

/// The fields of a Hugging Face `config.json` with `"model_type": "mpnet"` that the model reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
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

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    heads: usize,
    head_size: usize,
}

impl Layer {
    fn load(vb: VarBuilder, c: &Config) -> Result<Layer> {
        let h = c.hidden_size;
        let attn = vb.pp("attention.attn");
        Ok(Layer {
            q: linear(h, h, attn.pp("q"))?,
            k: linear(h, h, attn.pp("k"))?,
            v: linear(h, h, attn.pp("v"))?,
            o: linear(h, h, attn.pp("o"))?,
            attention_norm: layer_norm(h, c.layer_norm_eps, vb.pp("attention.LayerNorm"))?,
            intermediate: linear(h, c.intermediate_size, vb.pp("intermediate.dense"))?,
            output: linear(c.intermediate_size, h, vb.pp("output.dense"))?,
            output_norm: layer_norm(h, c.layer_norm_eps, vb.pp("output.LayerNorm"))?,
            heads: c.num_attention_heads,
            head_size: h / c.num_attention_heads,
        })
    }

    /// `bias`: (1, heads, len, len) relative-position bias plus the padding mask (batch, 1, 1,
    /// len), already summed.
    fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (b, len, h) = x.dims3()?;
        let split = |t: Tensor| -> Result<Tensor> {
            t.reshape((b, len, self.heads, self.head_size))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q.forward(x)?)?;
        let k = split(self.k.forward(x)?)?;
        let v = split(self.v.forward(x)?)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_size as f64).sqrt())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(bias)?)?;
        let context = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, len, h))?;
        let attended = self
            .attention_norm
            .forward(&(self.o.forward(&context)? + x)?)?;
        let inner = self.intermediate.forward(&attended)?.gelu_erf()?;
        self.output_norm
            .forward(&(self.output.forward(&inner)? + attended)?)
    }
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
        let layers = (0..c.num_hidden_layers)
            .map(|i| Layer::load(vb.pp(format!("encoder.layer.{i}")), c))
            .collect::<Result<_>>()?;
        Ok(MpNetModel {
            words: embedding(c.vocab_size, c.hidden_size, e.pp("word_embeddings"))?,
            positions: embedding(
                c.max_position_embeddings,
                c.hidden_size,
                e.pp("position_embeddings"),
            )?,
            norm: layer_norm(c.hidden_size, c.layer_norm_eps, e.pp("LayerNorm"))?,
            layers,
            relative_bias: embedding(
                c.relative_attention_num_buckets,
                c.num_attention_heads,
                vb.pp("encoder.relative_attention_bias"),
            )?,
            buckets: c.relative_attention_num_buckets,
            pad: c.pad_token_id,
            max_positions: c.max_position_embeddings,
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
        let padding = ((mask.to_dtype(DType::F32)? - 1.0)? * f64::from(f32::MAX))?
            .unsqueeze(1)?
            .unsqueeze(1)?;
        let bias = relative.broadcast_add(&padding)?.contiguous()?;
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

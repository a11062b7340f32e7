//! What BERT and MPNet share: dense layers with 8-bit weights and the encoder layer (attention,
//! then a feed-forward block, each added to its input and normalised). The two differ in how
//! tokens are embedded and in the names of their weights ([`Names`]).

use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder, embedding, layer_norm};

use crate::int8::Int8Linear;

/// A dense layer with 8-bit weights, one scale per output, its bias in f32 ([`crate::int8`]). A
/// request is a dozen tokens, and a product of a dozen rows with an f32 matrix spends most of
/// its time repacking the matrix; 8-bit rows are read as stored. BENCHMARKS.md "find" has what
/// each representation costs and finds.
#[derive(Debug)]
pub struct Linear(Int8Linear);

pub fn linear(input: usize, output: usize, vb: VarBuilder) -> Result<Linear> {
    stacked(input, output, &[vb])
}

/// Several dense layers of the same input as one, their outputs side by side in the order of
/// `parts` (`output` each): the query, key and value projections read the same rows, so one
/// product quantizes the input once and goes over it once. Each output keeps its own scale,
/// so the values are those of the separate layers.
fn stacked(input: usize, output: usize, parts: &[VarBuilder]) -> Result<Linear> {
    let (mut weight, mut bias) = (Vec::new(), Vec::new());
    for vb in parts {
        weight.extend(
            vb.get((output, input), "weight")?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
        bias.extend(vb.get(output, "bias")?.to_vec1::<f32>()?);
    }
    let outputs = output * parts.len();
    Ok(Linear(Int8Linear::new(&weight, bias, input, outputs)))
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, |v| v)
    }
}

/// The feed-forward block's activation, by `hidden_act` in `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// GELU as the reference computes it, with the error function.
    Gelu,
    /// GELU approximated with tanh.
    #[serde(alias = "gelu_pytorch_tanh")]
    GeluNew,
    Relu,
}

impl Linear {
    /// The layer followed by `activation`; GELU with the error function is applied as each
    /// output is made ([`crate::int8::gelu`]), the others by candle.
    fn forward_then(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        match activation {
            Activation::Gelu => self.run(x, crate::int8::gelu),
            Activation::GeluNew => self.forward(x)?.gelu(),
            Activation::Relu => self.forward(x)?.relu(),
        }
    }

    fn run(&self, x: &Tensor, activation: impl Fn(f32) -> f32) -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        let inputs = dims.pop().unwrap_or(0);
        if inputs != self.0.inputs() {
            candle_core::bail!("dense layer of {} inputs given {inputs}", self.0.inputs());
        }
        let rows = dims.iter().product();
        let y = self
            .0
            .forward_then(&x.flatten_all()?.to_vec1()?, rows, activation);
        dims.push(self.0.outputs());
        Tensor::from_vec(y, dims, x.device())
    }
}

/// Where a layer's weights are, relative to the layer: BERT and MPNet name them differently.
pub struct Names {
    pub query: &'static str,
    pub key: &'static str,
    pub value: &'static str,
    pub attention_out: &'static str,
    pub attention_norm: &'static str,
}

/// The fields of a Hugging Face `config.json` that BERT and MPNet read alike. `hidden_size` is a
/// multiple of `num_attention_heads` (checked when the configuration is read).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Sizes {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_activation")]
    pub hidden_act: Activation,
}

fn default_activation() -> Activation {
    Activation::Gelu
}

/// The embeddings every encoder here starts with: one vector per word and per position.
pub fn word_and_position_embeddings(
    sizes: &Sizes,
    vb: VarBuilder,
) -> Result<(Embedding, Embedding)> {
    Ok((
        embedding(
            sizes.vocab_size,
            sizes.hidden_size,
            vb.pp("word_embeddings"),
        )?,
        embedding(
            sizes.max_position_embeddings,
            sizes.hidden_size,
            vb.pp("position_embeddings"),
        )?,
    ))
}

/// The `num_hidden_layers` layers under `encoder.layer.N`.
pub fn layers(
    sizes: &Sizes,
    layer_norm_eps: f64,
    vb: VarBuilder,
    names: &Names,
) -> Result<Vec<Layer>> {
    (0..sizes.num_hidden_layers)
        .map(|i| {
            Layer::load(
                vb.pp(format!("encoder.layer.{i}")),
                sizes,
                layer_norm_eps,
                names,
            )
        })
        .collect()
}

pub struct Layer {
    /// The query, key and value projections stacked ([`stacked`]).
    qkv: Linear,
    o: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    activation: Activation,
    heads: usize,
    head_size: usize,
}

impl Layer {
    fn load(vb: VarBuilder, sizes: &Sizes, eps: f64, names: &Names) -> Result<Layer> {
        let (h, i) = (sizes.hidden_size, sizes.intermediate_size);
        Ok(Layer {
            qkv: stacked(
                h,
                h,
                &[vb.pp(names.query), vb.pp(names.key), vb.pp(names.value)],
            )?,
            o: linear(h, h, vb.pp(names.attention_out))?,
            attention_norm: layer_norm(h, eps, vb.pp(names.attention_norm))?,
            intermediate: linear(h, i, vb.pp("intermediate.dense"))?,
            output: linear(i, h, vb.pp("output.dense"))?,
            output_norm: layer_norm(h, eps, vb.pp("output.LayerNorm"))?,
            activation: sizes.hidden_act,
            heads: sizes.num_attention_heads,
            head_size: h / sizes.num_attention_heads,
        })
    }

    /// `bias`: added to the attention scores before the softmax, broadcast to (batch, heads,
    /// len, len): the padding mask, plus MPNet's relative-position bias.
    pub fn forward(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        let (b, len, _) = x.dims3()?;
        let qkv = self.qkv.forward(x)?;
        let (heads, d) = (self.heads, self.head_size);
        let context = if b * heads * len * len * d <= SMALL_ATTENTION {
            small_attention(&qkv, bias, heads, d)?
        } else {
            attention(&qkv, bias, heads, d)?
        };
        let attended = self
            .attention_norm
            .forward(&(self.o.forward(&context)? + x)?)?;
        let inner = self.intermediate.forward_then(&attended, self.activation)?;
        self.output_norm
            .forward(&(self.output.forward(&inner)? + attended)?)
    }
}

/// Each token's attention over the others, (batch, len, hidden), from the stacked query,
/// key and value projections (batch, len, 3 × hidden) of `heads` heads of `d` values, with
/// candle's products.
fn attention(qkv: &Tensor, bias: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
    let (b, len, three_h) = qkv.dims3()?;
    let h = three_h / 3;
    let split = |part: usize| -> Result<Tensor> {
        qkv.narrow(2, part * h, h)?
            .reshape((b, len, heads, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(bias)?)?;
    probs.matmul(&v)?.transpose(1, 2)?.reshape((b, len, h))
}

/// What [`attention`] computes, in plain loops over the stacked projections: for a
/// request (a dozen tokens), candle's dozen operations a layer, each allocating its
/// result, cost more than the arithmetic (a quarter of a MiniLM request).
fn small_attention(qkv: &Tensor, bias: &Tensor, heads: usize, d: usize) -> Result<Tensor> {
    let (b, len, three_h) = qkv.dims3()?;
    let h = three_h / 3;
    let device = qkv.device().clone();
    let bias = bias
        .broadcast_as((b, heads, len, len))?
        .contiguous()?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let qkv = qkv.flatten_all()?.to_vec1::<f32>()?;
    let scale = 1.0 / (d as f32).sqrt();
    let mut context = vec![0f32; b * len * h];
    let mut probs = vec![0f32; len];
    for batch in 0..b {
        let token = |i: usize| &qkv[(batch * len + i) * three_h..][..three_h];
        for head in 0..heads {
            let part = |i: usize, which: usize| &token(i)[which * h + head * d..][..d];
            for i in 0..len {
                let q = part(i, 0);
                let row_bias = &bias[((batch * heads + head) * len + i) * len..][..len];
                for (j, (p, &bias)) in probs.iter_mut().zip(row_bias).enumerate() {
                    *p = crate::encoder::cosine(q, part(j, 1)) * scale + bias;
                }
                let max = probs.iter().fold(f32::NEG_INFINITY, |m, &p| m.max(p));
                let mut sum = 0.0;
                for p in probs.iter_mut() {
                    *p = (*p - max).exp();
                    sum += *p;
                }
                let out = &mut context[(batch * len + i) * h + head * d..][..d];
                for (j, &p) in probs.iter().enumerate() {
                    let weight = p / sum;
                    for (o, &v) in out.iter_mut().zip(part(j, 2)) {
                        *o += weight * v;
                    }
                }
            }
        }
    }
    Tensor::from_vec(context, (b, len, h), &device)
}

/// Attention of at most this many multiply-adds (batch × heads × len² × head size) runs in
/// [`small_attention`]: a request of up to some 50 tokens; index builds, 16 texts at a
/// time, go through candle's products.
const SMALL_ATTENTION: usize = 1 << 21;

/// The padding mask as an additive attention bias, (batch, 1, 1, len): 0 for a real token, a
/// large negative number for padding, so that no token attends to padding.
pub fn padding_bias(mask: &Tensor) -> Result<Tensor> {
    ((mask.to_dtype(candle_core::DType::F32)? - 1.0)? * f64::from(f32::MAX))?
        .unsqueeze(1)?
        .unsqueeze(1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests fail loudly by design.

    use super::*;
    use candle_core::Device;

    #[test]
    fn small_attention_matches_candles() {
        let (b, len, heads, d) = (2, 5, 3, 4);
        let h = heads * d;
        let mut seed = 0x853c_49e6_748f_ea9bu64;
        let mut random = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect()
        };
        let qkv = Tensor::from_vec(random(b * len * 3 * h), (b, len, 3 * h), &Device::Cpu).unwrap();
        // The padding mask alone (the second text is two tokens shorter), and with a bias per
        // head and pair of tokens as MPNet adds.
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 1], [1, 1, 1, 0, 0]], &Device::Cpu).unwrap();
        let padding = padding_bias(&mask).unwrap();
        let relative = Tensor::from_vec(
            random(heads * len * len),
            (1, heads, len, len),
            &Device::Cpu,
        )
        .unwrap();
        for bias in [padding.clone(), padding.broadcast_add(&relative).unwrap()] {
            let want = attention(&qkv, &bias, heads, d).unwrap();
            let got = small_attention(&qkv, &bias, heads, d).unwrap();
            assert_eq!(got.dims(), want.dims());
            let (got, want) = (
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
    }
}

//! What BERT and MPNet share: dense layers with 8-bit weights and the encoder layer (attention,
//! then a feed-forward block, each added to its input and normalised). The two differ in how
//! tokens are embedded and in the names of their weights ([`Names`]).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, VarBuilder, embedding, layer_norm};

/// A dense layer with its weights quantized to 8 bits (blocks of 32 weights sharing one f16
/// scale: 8.5 bits a weight instead of 32), its bias kept in f32. A request is a dozen tokens,
/// and a product of a dozen rows with an f32 matrix spends most of its time repacking the
/// matrix; 8-bit blocks are read as stored. Measured (BENCHMARKS.md "find"): a request encodes
/// 3.2 times as fast with MPNet and 4.8 times with MiniLM, an index of 1,000 tools builds 1.9
/// times as fast with MiniLM, and the top three hold the right tool for one or two requests
/// fewer of the 123 paraphrases.
pub struct Linear {
    weight: QMatMul,
    bias: Tensor,
    /// Zero columns added to the input (and to the weights) so that its width is a multiple of
    /// [`WIDTH_STEP`].
    padding: usize,
}

/// Input widths that are a multiple of this take candle's fastest 8-bit kernels (on CPUs with
/// VNNI instructions); narrower layers (MiniLM's 384) are padded with zero columns, which adds
/// products that change nothing and is still faster (BENCHMARKS.md "find").
const WIDTH_STEP: usize = 256;

pub fn linear(input: usize, output: usize, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get((output, input), "weight")?;
    let padding = input.next_multiple_of(WIDTH_STEP) - input;
    let weight = weight.pad_with_zeros(1, 0, padding)?;
    Ok(Linear {
        weight: QMatMul::from_qtensor(QTensor::quantize(&weight, GgmlDType::Q8_0)?)?,
        bias: vb.get(output, "bias")?,
        padding,
    })
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let product = if self.padding > 0 {
            let x = x.pad_with_zeros(candle_core::D::Minus1, 0, self.padding)?;
            self.weight.forward(&x)?
        } else {
            self.weight.forward(x)?
        };
        product.broadcast_add(&self.bias)
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

impl Activation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Gelu => x.gelu_erf(),
            Activation::GeluNew => x.gelu(),
            Activation::Relu => x.relu(),
        }
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
    q: Linear,
    k: Linear,
    v: Linear,
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
            q: linear(h, h, vb.pp(names.query))?,
            k: linear(h, h, vb.pp(names.key))?,
            v: linear(h, h, vb.pp(names.value))?,
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
        let inner = self
            .activation
            .apply(&self.intermediate.forward(&attended)?)?;
        self.output_norm
            .forward(&(self.output.forward(&inner)? + attended)?)
    }
}

/// The padding mask as an additive attention bias, (batch, 1, 1, len): 0 for a real token, a
/// large negative number for padding, so that no token attends to padding.
pub fn padding_bias(mask: &Tensor) -> Result<Tensor> {
    ((mask.to_dtype(candle_core::DType::F32)? - 1.0)? * f64::from(f32::MAX))?
        .unsqueeze(1)?
        .unsqueeze(1)
}

//! Dense layers as integer products: weights stored as 8-bit integers with one scale per output
//! (row of the weight matrix), each input row quantized to 16-bit integers with one scale when
//! the layer runs, and the sums made in 32-bit integers.
//!
//! Why not candle's 8-bit blocks (`Q8_0`): on CPUs without AVX-512 VNNI (AMD Zen 3, most Intel
//! desktops), its products convert each block of 32 weights' sum to floating point, which made
//! a request to all-MiniLM-L6-v2 take 23 ms here against 5 ms on a CPU with VNNI
//! (BENCHMARKS.md "find"). Summing whole rows in integers leaves one conversion per output.
//! The input keeps 12 to 15 bits (as many as the row length allows without a 32-bit sum
//! overflowing), so the 8-bit weights are the only coarse part, as in candle's blocks.
//!
//! With AVX2 the products run 16 pairs an instruction (`vpmaddwd`), four input rows by two
//! weight rows at a time, so each loaded value serves two or four products, and each weight
//! is read from memory once per product whatever the number of input rows; elsewhere a plain
//! loop computes the same integers (a test checks both agree exactly). Large products are split
//! by output columns over rayon's threads.
#![allow(unsafe_code)]

use rayon::prelude::*;

/// The row length is padded with zeros to a multiple of this: one AVX2 step.
const STEP: usize = 16;

/// Products smaller than this (multiply-adds) run on the calling thread: splitting them costs
/// more than it saves.
const PARALLEL_MIN: usize = 1 << 18;

/// A dense layer `y = x Wᵀ + b` with `W` as 8-bit integers.
#[derive(Clone)]
pub struct Int8Linear {
    inputs: usize,
    outputs: usize,
    /// `inputs` rounded up to [`STEP`]: the stride of `weights` and of quantized inputs.
    stride: usize,
    /// `outputs` rows of `stride` values, zero past `inputs`.
    weights: Vec<i8>,
    /// Per output row: the weight a quantized 1 stands for.
    scales: Vec<f32>,
    bias: Vec<f32>,
}

/// Sizes only: the weights are megabytes.
impl std::fmt::Debug for Int8Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Int8Linear")
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish_non_exhaustive()
    }
}

impl Int8Linear {
    /// `weight` is `outputs` rows of `inputs` values (PyTorch's layout), `bias` `outputs` values.
    pub fn new(weight: &[f32], bias: Vec<f32>, inputs: usize, outputs: usize) -> Int8Linear {
        assert_eq!(weight.len(), inputs * outputs, "weight shape");
        assert_eq!(bias.len(), outputs, "bias shape");
        let stride = inputs.next_multiple_of(STEP);
        let mut weights = vec![0i8; outputs * stride];
        let mut scales = vec![0f32; outputs];
        for (o, row) in weight.chunks_exact(inputs).enumerate() {
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if max > 0.0 && max.is_finite() {
                max / 127.0
            } else {
                0.0
            };
            scales[o] = scale;
            if scale > 0.0 {
                for (q, v) in weights[o * stride..].iter_mut().zip(row) {
                    *q = round(v / scale).clamp(-127, 127) as i8;
                }
            }
        }
        Int8Linear {
            inputs,
            outputs,
            stride,
            weights,
            scales,
            bias,
        }
    }

    pub fn inputs(&self) -> usize {
        self.inputs
    }

    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// `x` is `rows` rows of `inputs` values; returns `rows` rows of `outputs` values, each
    /// passed through `activation`.
    pub fn forward_then(
        &self,
        x: &[f32],
        rows: usize,
        activation: impl Fn(f32) -> f32,
    ) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.inputs, "input shape");
        let (quantized, input_scales) = quantize_rows(x, rows, self.inputs, self.stride);
        let sums = self.products(&quantized, rows);
        let mut y = vec![0f32; rows * self.outputs];
        for (r, (out, sums)) in y
            .chunks_exact_mut(self.outputs)
            .zip(sums.chunks_exact(self.outputs))
            .enumerate()
        {
            let s = input_scales[r];
            for (o, value) in out.iter_mut().enumerate() {
                *value = activation(sums[o] as f32 * (s * self.scales[o]) + self.bias[o]);
            }
        }
        y
    }

    /// The integer products of every input row with every weight row, `rows × outputs`.
    fn products(&self, a: &[i16], rows: usize) -> Vec<i32> {
        let work = rows * self.outputs * self.stride;
        if work < PARALLEL_MIN || rayon::current_num_threads() < 2 {
            let mut sums = vec![0i32; rows * self.outputs];
            self.columns(a, rows, 0..self.outputs, &mut sums, self.outputs);
            return sums;
        }
        // Column ranges a multiple of the tile width, a few per thread to even out the load.
        let pieces = rayon::current_num_threads() * 4;
        let width = self.outputs.div_ceil(pieces).next_multiple_of(TILE_COLS);
        let parts: Vec<(usize, Vec<i32>)> = (0..self.outputs)
            .step_by(width)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|start| {
                let end = (start + width).min(self.outputs);
                let mut part = vec![0i32; rows * (end - start)];
                self.columns(a, rows, start..end, &mut part, end - start);
                (start, part)
            })
            .collect();
        let mut sums = vec![0i32; rows * self.outputs];
        for (start, part) in parts {
            let width = part.len() / rows.max(1);
            for r in 0..rows {
                sums[r * self.outputs + start..][..width]
                    .copy_from_slice(&part[r * width..][..width]);
            }
        }
        sums
    }

    /// Products for the output columns `cols`, into `out` (`rows` rows of `out_stride`, column
    /// `cols.start` first). Within a block of [`ROW_BLOCK`] input rows, pairs of weight rows are
    /// the outer loop: a pair is read once and stays in the first-level cache while every row of
    /// the block goes by. A request is one block, so each weight comes from memory once (with
    /// the input rows outside, a request of a dozen tokens read each weight three times).
    fn columns(
        &self,
        a: &[i16],
        rows: usize,
        cols: std::ops::Range<usize>,
        out: &mut [i32],
        out_stride: usize,
    ) {
        let s = self.stride;
        for block in (0..rows).step_by(ROW_BLOCK) {
            let block_end = (block + ROW_BLOCK).min(rows);
            let mut c = cols.start;
            while c < cols.end {
                let nc = (cols.end - c).min(TILE_COLS);
                let w_rows: [&[i8]; TILE_COLS] =
                    std::array::from_fn(|j| &self.weights[(c + j.min(nc - 1)) * s..][..s]);
                let mut r = block;
                while r < block_end {
                    let nr = (block_end - r).min(TILE_ROWS);
                    let at = |i: usize| &a[(r + i) * s..][..s];
                    let mut put = |i: usize, sums: &[i32; TILE_COLS]| {
                        out[(r + i) * out_stride + (c - cols.start)..][..nc]
                            .copy_from_slice(&sums[..nc]);
                    };
                    // One kernel per number of rows, so that a short last tile (or a single
                    // request) computes no repeated rows.
                    match nr {
                        1 => tile_rows::<1>(at, &w_rows, &mut put),
                        2 => tile_rows::<2>(at, &w_rows, &mut put),
                        3 => tile_rows::<3>(at, &w_rows, &mut put),
                        _ => tile_rows::<TILE_ROWS>(at, &w_rows, &mut put),
                    }
                    r += nr;
                }
                c += nc;
            }
        }
    }
}

/// Input rows taken together against each pair of weight rows: 16 rows of 768 16-bit values
/// (24 KB) fit in the first-level cache beside the pair, and a request of up to 14 words is one
/// block. Index builds run many more rows; the weights are read once per block.
const ROW_BLOCK: usize = 16;

/// The products of `R` input rows (`at(0..R)`) with the weight rows `w` (in a partial tile, the
/// caller repeats its last weight row and ignores the repeats), handed to `put` row by row.
fn tile_rows<'a, const R: usize>(
    at: impl Fn(usize) -> &'a [i16],
    w: &[&[i8]; TILE_COLS],
    put: &mut impl FnMut(usize, &[i32; TILE_COLS]),
) {
    let a: [&[i16]; R] = std::array::from_fn(at);
    let mut sums = [[0i32; TILE_COLS]; R];
    dot_tile(&a, w, &mut sums);
    for (i, sums) in sums.iter().enumerate() {
        put(i, sums);
    }
}

/// Input rows by weight rows computed together: each loaded value serves several products,
/// and the 8 sums, 2 weight vectors, the input vector and a product fit in AVX2's 16 registers
/// (4 × 3 spilled sums to memory and was slower).
const TILE_ROWS: usize = 4;
const TILE_COLS: usize = 2;

/// Each row as 16-bit integers (zero past `inputs`, up to `stride`) and the value a 1 stands
/// for. The largest magnitude is chosen so that no sum of `stride` products with 8-bit weights
/// can overflow 32 bits: 32,767 for rows up to 516 values, 5,504 for 3,072.
fn quantize_rows(x: &[f32], rows: usize, inputs: usize, stride: usize) -> (Vec<i16>, Vec<f32>) {
    let limit = (i32::MAX as usize / (stride.max(1) * 127)).min(i16::MAX as usize) as f32;
    let mut quantized = vec![0i16; rows * stride];
    let mut scales = vec![0f32; rows];
    for (r, row) in x.chunks_exact(inputs).enumerate() {
        scales[r] = quantize_row(row, limit, &mut quantized[r * stride..][..inputs]);
    }
    (quantized, scales)
}

/// Quantizes `row` into `out` with `limit` the largest magnitude; returns the value a 1 stands
/// for (0 for a row of zeros or with an infinite value, left all 0). With AVX2, whole groups of
/// 8 values go through `avx2::quantize`, which gives the integers [`quantize_values`] gives.
fn quantize_row(row: &[f32], limit: f32, out: &mut [i16]) -> f32 {
    let max = max_abs(row);
    if !(max > 0.0 && max.is_finite()) {
        return 0.0;
    }
    let inverse = limit / max;
    #[allow(unused_mut)] // Only x86-64 hands part of the row to the AVX2 loop.
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above), and `out` is as long as `row`.
        done = unsafe { avx2::quantize(row, inverse, limit, out) };
    }
    quantize_values(&row[done..], inverse, limit, &mut out[done..]);
    max / limit
}

/// Each value times `inverse`, clamped to ±`limit` before rounding (a product may land a
/// rounding error past the limit), so that the loop has no branch; NaN rounds to 0.
fn quantize_values(row: &[f32], inverse: f32, limit: f32, out: &mut [i16]) {
    for (q, v) in out.iter_mut().zip(row) {
        *q = round((v * inverse).clamp(-limit, limit)) as i16;
    }
}

/// The largest magnitude in `row`, NaN ignored; in 8 lanes, so that it is vectorised (a single
/// running maximum must go in order).
fn max_abs(row: &[f32]) -> f32 {
    const LANES: usize = 8;
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut lanes = [0f32; LANES];
    for chunk in chunks {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v.abs());
        }
    }
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

/// Nearest integer, halves away from zero; a cast rather than `f32::round`, which is a library
/// call on a CPU target without SSE 4.1 and took a tenth of a request's time. Out of range and
/// NaN give the cast's saturated values and 0, which the callers clamp.
fn round(v: f32) -> i32 {
    (v + 0.5f32.copysign(v)) as i32
}

/// GELU as BERT and MPNet define it, `x Φ(x)` with the error function, whose library version
/// took a tenth of a request's time: here a rational approximation (the one Eigen uses for
/// single precision, odd numerator of degree 13 over an even denominator of degree 8, on
/// [-4, 4] where `erf` reaches 1 in single precision), within 1e-6 of `erf`.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10f32;
    for c in [
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.954_6e-3,
        -1.609_603_3e-2,
    ] {
        p = p * x2 + c;
    }
    let mut q = -1.456_607_2e-5f32;
    for c in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = q * x2 + c;
    }
    x * p / q
}

/// The products of each row of `a` with each row of `w` into `out`. Every slice has the same
/// length, a multiple of [`STEP`].
fn dot_tile<const R: usize>(
    a: &[&[i16]; R],
    w: &[&[i8]; TILE_COLS],
    out: &mut [[i32; TILE_COLS]; R],
) {
    let len = a[0].len();
    assert!(
        len.is_multiple_of(STEP)
            && a.iter().all(|r| r.len() == len)
            && w.iter().all(|r| r.len() == len),
        "tile rows of unequal or unpadded length"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above), and every slice holds `len` values, a
        // multiple of 16 (asserted above), which is all the kernel reads.
        unsafe { avx2::tile(a, w, out) };
        return;
    }
    portable_tile(a, w, out);
}

/// What the AVX2 kernel computes, in plain integer arithmetic.
fn portable_tile<const R: usize>(
    a: &[&[i16]; R],
    w: &[&[i8]; TILE_COLS],
    out: &mut [[i32; TILE_COLS]; R],
) {
    for (row, out) in a.iter().zip(out.iter_mut()) {
        for (weights, sum) in w.iter().zip(out.iter_mut()) {
            *sum = row
                .iter()
                .zip(weights.iter())
                .map(|(&x, &y)| i32::from(x) * i32::from(y))
                .sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{STEP, TILE_COLS};
    use std::arch::x86_64::*;

    /// [`super::quantize_values`] for the whole groups of 8 values of `row`, 8 values an
    /// instruction, giving the same integers: the same product, clamp, sign-matched half added
    /// and truncation, NaN to 0. Returns how many values it did; the rest are the caller's.
    ///
    /// # Safety
    /// The CPU supports AVX2, and `out` is at least as long as `row`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize(row: &[f32], inverse: f32, limit: f32, out: &mut [i16]) -> usize {
        let (inv, low, high) = (
            _mm256_set1_ps(inverse),
            _mm256_set1_ps(-limit),
            _mm256_set1_ps(limit),
        );
        let (half, sign) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.0));
        let whole = row.len() / 8 * 8;
        assert!(
            out.len() >= row.len(),
            "quantized row shorter than its input"
        );
        let mut i = 0;
        while i < whole {
            // SAFETY (loads, stores): i + 8 <= row.len() <= out.len().
            let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(row.as_ptr().add(i)) }, inv);
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let c = _mm256_min_ps(_mm256_max_ps(v, low), high);
            let rounded = _mm256_add_ps(c, _mm256_or_ps(half, _mm256_and_ps(c, sign)));
            let ints = _mm256_andnot_si256(nan, _mm256_cvttps_epi32(rounded));
            let packed = _mm_packs_epi32(
                _mm256_castsi256_si128(ints),
                _mm256_extracti128_si256::<1>(ints),
            );
            unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), packed) };
            i += 8;
        }
        whole
    }

    /// # Safety
    /// The CPU supports AVX2, and every slice of `a` and `w` holds the same number of values,
    /// a multiple of [`STEP`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn tile<const R: usize>(
        a: &[&[i16]; R],
        w: &[&[i8]; TILE_COLS],
        out: &mut [[i32; TILE_COLS]; R],
    ) {
        let len = a[0].len();
        let mut acc = [[_mm256_setzero_si256(); TILE_COLS]; R];
        let mut i = 0;
        while i < len {
            // SAFETY (loads): i + 16 <= len for every slice, by the caller's contract.
            let mut wv = [_mm256_setzero_si256(); TILE_COLS];
            for (v, row) in wv.iter_mut().zip(w.iter()) {
                *v = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(row.as_ptr().add(i).cast()) });
            }
            for (row, acc) in a.iter().zip(acc.iter_mut()) {
                let av = unsafe { _mm256_loadu_si256(row.as_ptr().add(i).cast()) };
                for (sum, wv) in acc.iter_mut().zip(wv.iter()) {
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(av, *wv));
                }
            }
            i += STEP;
        }
        for (acc, out) in acc.iter().zip(out.iter_mut()) {
            for (sum, out) in acc.iter().zip(out.iter_mut()) {
                *out = horizontal_sum(*sum);
            }
        }
    }

    #[target_feature(enable = "avx2")]
    fn horizontal_sum(v: __m256i) -> i32 {
        let halves = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let pairs = _mm_add_epi32(halves, _mm_shuffle_epi32::<0b01_00_11_10>(halves));
        let one = _mm_add_epi32(pairs, _mm_shuffle_epi32::<0b10_11_00_01>(pairs));
        _mm_cvtsi128_si32(one)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                (*seed % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], w: &[f32], b: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; rows * n];
        for r in 0..rows {
            for o in 0..n {
                let dot: f32 = (0..k).map(|i| x[r * k + i] * w[o * k + i]).sum();
                y[r * n + o] = dot + b[o];
            }
        }
        y
    }

    #[test]
    fn matches_the_float_product_within_quantization_error() {
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        // Odd sizes: rows and columns that leave partial tiles, lengths that need padding, one
        // product big enough to be split over threads, and rows over more than one block with a
        // partial last one.
        for (rows, k, n) in [
            (1, 1, 1),
            (5, 37, 7),
            (14, 384, 384),
            (13, 3072, 200),
            (3, 16, 4),
            (2 * ROW_BLOCK + 3, 48, 9),
        ] {
            let x = random(rows * k, &mut seed);
            let w = random(n * k, &mut seed);
            let b = random(n, &mut seed);
            let layer = Int8Linear::new(&w, b.clone(), k, n);
            let got = layer.forward_then(&x, rows, |v| v);
            let want = reference(&x, &w, &b, rows, k, n);
            // Each weight is off by at most half a step of 1/127 of its row's largest; the
            // error of a sum of k products grows like its square root.
            let bound = 0.01 * (k as f32).sqrt() + 1e-4;
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= bound, "{rows}x{k}x{n}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn gelu_follows_the_error_function() {
        // erf from its series, in f64: exact enough on [-4, 4] to judge an f32 approximation.
        fn erf64(x: f64) -> f64 {
            let mut term = x;
            let mut sum = x;
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }
        let mut worst = 0f64;
        for i in -6000..=6000 {
            let x = i as f64 / 1000.0;
            let want = if x.abs() <= 4.0 { erf64(x) } else { x.signum() };
            worst = worst.max((f64::from(erf(x as f32)) - want).abs());
        }
        assert!(worst < 1e-6, "worst error {worst}");
        assert_eq!(gelu(0.0), 0.0);
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu(-3.0) + 0.004_049_7).abs() < 1e-6);
        assert_eq!(round(2.5), 3);
        assert_eq!(round(-2.5), -3);
        assert_eq!(round(-0.4), 0);
    }

    #[test]
    fn both_kernels_give_the_same_integers() {
        let mut seed = 7;
        let len = 3072;
        let a: Vec<Vec<i16>> = (0..TILE_ROWS)
            .map(|_| {
                random(len, &mut seed)
                    .iter()
                    .map(|v| (v * 5504.0) as i16)
                    .collect()
            })
            .collect();
        let w: Vec<Vec<i8>> = (0..TILE_COLS)
            .map(|_| {
                random(len, &mut seed)
                    .iter()
                    .map(|v| (v * 127.0) as i8)
                    .collect()
            })
            .collect();
        let a: [&[i16]; TILE_ROWS] = std::array::from_fn(|i| a[i].as_slice());
        let w: [&[i8]; TILE_COLS] = std::array::from_fn(|i| w[i].as_slice());
        let mut single = [[0; TILE_COLS]; 1];
        dot_tile(&[a[0]], &w, &mut single);
        let mut portable = [[0; TILE_COLS]; TILE_ROWS];
        portable_tile(&a, &w, &mut portable);
        let mut dispatched = [[0; TILE_COLS]; TILE_ROWS];
        dot_tile(&a, &w, &mut dispatched);
        assert_eq!(portable, dispatched);
        assert_eq!(single[0], portable[0]);
        assert!(portable.iter().flatten().any(|&v| v != 0));
    }

    #[test]
    fn both_quantizers_give_the_same_integers() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let mut seed = 0x2545_f491_4f6c_dd1d;
            let mut rows: Vec<Vec<f32>> = [1, 7, 8, 9, 384, 3072, 3075]
                .iter()
                .map(|&n| random(n, &mut seed))
                .collect();
            // Halves after scaling (ties round away from zero), the largest value of each sign,
            // tiny values, a NaN among numbers, and a row of zeros.
            rows.push((0..40).map(|i| (i as f32 - 20.0) * 0.5).collect());
            rows.push(vec![
                1e-30, -1e-30, 3.0, -3.0, 2.9999, -2.9999, 0.0, -0.0, 1.5,
            ]);
            rows.push(vec![
                1.0,
                f32::NAN,
                -2.0,
                0.25,
                0.75,
                -0.75,
                0.5,
                2.0,
                f32::NAN,
                1.0,
            ]);
            rows.push(vec![0.0; 17]);
            for row in &rows {
                for limit in [32_767.0f32, 5_504.0, 127.0] {
                    // The plain loop over the whole row, as a CPU without AVX2 quantizes it.
                    let max = max_abs(row);
                    let mut plain = vec![0i16; row.len()];
                    let plain_scale = if max > 0.0 && max.is_finite() {
                        quantize_values(row, limit / max, limit, &mut plain);
                        max / limit
                    } else {
                        0.0
                    };
                    let mut fast = vec![0i16; row.len()];
                    let fast_scale = quantize_row(row, limit, &mut fast);
                    assert_eq!(plain, fast, "{} values, limit {limit}", row.len());
                    assert_eq!(plain_scale.to_bits(), fast_scale.to_bits());
                }
            }
        }
    }

    #[test]
    fn extreme_inputs_neither_overflow_nor_poison_the_output() {
        let k = 3072;
        let w = vec![1.0f32; k];
        let layer = Int8Linear::new(&w, vec![0.0], k, 1);
        // Every input at its largest magnitude: the sum is the largest one possible.
        let y = layer.forward_then(&vec![-2.0f32; k], 1, |v| v);
        assert!((y[0] + 2.0 * k as f32).abs() < 1.0, "{}", y[0]);
        // A row of zeros, and one with a non-finite value, give finite outputs for the others.
        let y = layer.forward_then(&[vec![0.0; k], vec![f32::NAN; k]].concat(), 2, |v| v);
        assert_eq!(y[0], 0.0);
        assert!(y[1].is_finite());
    }
}

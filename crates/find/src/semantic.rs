//! The semantic score of a document for a request, from the vectors of its texts, and the two
//! corrections made per catalog when an index is built: centring and hubness.
//!
//! - **Centring.** Sentence vectors of one domain share a large common component, so every
//!   request is fairly close to every tool. The mean vector of the catalog's keyword phrases is
//!   subtracted from the request's and the tools' vectors (then scaled back to unit length), so
//!   that cosines compare what is particular to each text.
//! - **Hubness.** Some tools come out near the top for nearly any request (a "hub"): their
//!   texts are generic. Each tool's hub score is the mean of its `k` best scores against the
//!   keyword phrases of the other tools, taken as stand-in requests (they are short requests in
//!   users' words that the tool should not win); a fraction of it is subtracted from the tool's
//!   score, as in CSLS (Conneau et al., 2018, "Word translation without parallel data").
//!
//! Both only reorder the tools: how close a request is to any tool at all is still judged on
//! the plain cosine similarity (see [`Scores::plain`]).

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::FindError;
use crate::encoder::cosine;
use crate::int8::Int8Linear;

/// Fewest distinct keyword phrases in a catalog for centring and hubness: with a handful, the
/// mean is mostly those few texts and a tool's "other tools' keywords" are too few to say
/// whether it is generic.
const MIN_KEYWORDS: usize = 16;

/// Stand-in requests scored at once when measuring hubness: bounds the similarity matrix held
/// in memory (this many rows × every text of the catalog).
const HUB_BLOCK: usize = 256;

/// How centring and hubness are applied.
#[derive(Debug, Clone, Copy)]
pub struct Correction {
    /// Share of a tool's hub score subtracted from its score; 0 turns hubness off.
    pub hub_weight: f32,
    /// Best scores against other tools' keyword phrases averaged into a tool's hub score.
    pub hub_neighbours: usize,
}

/// The vectors of one document: its summary first, then each keyword phrase.
pub type DocVectors = Vec<Arc<[f32]>>;

/// What a catalog's documents contribute to a search: every text's vector in one matrix, the
/// centring and the hub penalties.
#[derive(Debug, Default)]
pub struct Semantic {
    /// Every text's plain vector as a row of 8-bit integers: one product with the request gives
    /// all its similarities (4,250 texts for 1,000 tools) from 1.6 MB with a 384-dimension
    /// model, where reading them as f32 vectors one by one, twice (plain and centred), took 4
    /// ms of a 10 ms search (BENCHMARKS.md "find"). `None` for an empty catalog.
    texts: Option<Int8Linear>,
    /// Where each document's texts start among the rows of `texts`, then the end.
    starts: Vec<usize>,
    /// Mean keyword vector subtracted before comparing; `None` for a catalog too small.
    centre: Option<Centre>,
    /// Per document, its hub score times the hub weight.
    penalty: Vec<f32>,
}

/// What the centred similarity of a request `q` and a text `d` needs besides `q·d`: with `m`
/// the centre and unit `q`, `d`, the cosine of `q − m` and `d − m` is
/// `(q·d − q·m − m·d + m·m) / (|q − m| |d − m|)`.
#[derive(Debug)]
struct Centre {
    mean: Vec<f32>,
    /// `m·m`.
    mean_norm2: f32,
    /// Per text: `m·d` and `|d − m|`.
    dot: Vec<f32>,
    norm: Vec<f32>,
}

impl Centre {
    fn new(mean: Vec<f32>, texts: &[&[f32]]) -> Centre {
        let mean_norm2 = cosine(&mean, &mean);
        let dot: Vec<f32> = texts.iter().map(|d| cosine(&mean, d)).collect();
        let norm = texts
            .iter()
            .zip(&dot)
            .map(|(d, md)| (cosine(d, d) - 2.0 * md + mean_norm2).max(0.0).sqrt())
            .collect();
        Centre {
            mean,
            mean_norm2,
            dot,
            norm,
        }
    }

    /// Centred similarity of text `t` from its plain one, given the request's `q·m` and
    /// `|q − m|`. A text (or request) equal to the mean has no direction of its own: it is close
    /// to nothing.
    fn similarity(&self, t: usize, plain: f32, query_dot: f32, query_norm: f32) -> f32 {
        let norms = query_norm * self.norm[t];
        if norms > 1e-6 {
            (plain - query_dot - self.dot[t] + self.mean_norm2) / norms
        } else {
            0.0
        }
    }
}

/// The semantic scores of one document for one request.
#[derive(Debug, Clone, Copy)]
pub struct Scores {
    /// What documents are ranked by: the centred score less the hub penalty.
    pub ranked: f32,
    /// The score from plain cosine similarities, uncorrected: whether the request is close to
    /// the document at all.
    pub plain: f32,
}

impl Semantic {
    /// Stacks the documents' vectors, centres them and measures each document's hubness.
    pub fn build(docs: &[DocVectors], correction: &Correction) -> Result<Semantic, FindError> {
        let mut starts = Vec::with_capacity(docs.len() + 1);
        let mut all: Vec<&[f32]> = Vec::new();
        for d in docs {
            starts.push(all.len());
            all.extend(d.iter().map(|v| &v[..]));
        }
        starts.push(all.len());
        let dims = all.first().map_or(0, |v| v.len());
        let texts = (!all.is_empty())
            .then(|| Int8Linear::new(&all.concat(), vec![0.0; all.len()], dims, all.len()));
        let mut keywords: Vec<&Arc<[f32]>> = docs.iter().flat_map(|d| d.iter().skip(1)).collect();
        keywords.sort_by(|a, b| {
            a.iter()
                .map(|x| x.to_bits())
                .cmp(b.iter().map(|x| x.to_bits()))
        });
        keywords.dedup_by(|a, b| a == b);
        if keywords.len() < MIN_KEYWORDS {
            return Ok(Semantic {
                texts,
                starts,
                centre: None,
                penalty: vec![0.0; docs.len()],
            });
        }
        let mut mean = vec![0.0f32; dims];
        for k in &keywords {
            for (c, x) in mean.iter_mut().zip(k.iter()) {
                *c += x;
            }
        }
        let n = keywords.len() as f32;
        mean.iter_mut().for_each(|c| *c /= n);
        let penalty = if correction.hub_weight > 0.0 {
            let centred: Vec<Vec<Vec<f32>>> = docs
                .iter()
                .map(|d| d.iter().map(|v| centre_vector(v, &mean)).collect())
                .collect();
            hubness(&centred, correction.hub_neighbours)?
                .into_iter()
                .map(|h| correction.hub_weight * h)
                .collect()
        } else {
            vec![0.0; docs.len()]
        };
        Ok(Semantic {
            texts,
            starts,
            centre: Some(Centre::new(mean, &all)),
            penalty,
        })
    }

    /// Every document's scores for the request's unit vector `query`, in document order.
    pub fn scores(&self, query: &[f32]) -> Vec<Scores> {
        let Some(texts) = &self.texts else {
            return Vec::new();
        };
        let plain = texts.forward_then(query, 1, |v| v);
        let centred: Vec<f32> = match &self.centre {
            Some(c) => {
                let query_dot = cosine(query, &c.mean);
                let query_norm = (1.0 - 2.0 * query_dot + c.mean_norm2).max(0.0).sqrt();
                plain
                    .iter()
                    .enumerate()
                    .map(|(t, &p)| c.similarity(t, p, query_dot, query_norm))
                    .collect()
            }
            None => plain.clone(),
        };
        self.starts
            .windows(2)
            .zip(&self.penalty)
            .map(|(range, penalty)| Scores {
                ranked: combine_sims(&centred[range[0]..range[1]]) - penalty,
                plain: combine_sims(&plain[range[0]..range[1]]),
            })
            .collect()
    }
}

fn centre_vector(v: &[f32], centre: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = v.iter().zip(centre).map(|(x, c)| x - c).collect();
    let norm = out.iter().map(|x| x * x).sum::<f32>().sqrt();
    // A text equal to the mean has no direction of its own: it is close to nothing.
    if norm > 1e-6 {
        out.iter_mut().for_each(|x| *x /= norm);
    } else {
        out.iter_mut().for_each(|x| *x = 0.0);
    }
    out
}

/// Per document, the mean of its `k` best scores against the keyword phrases of the other
/// documents. The similarities of every keyword phrase to every text of the catalog are
/// matrix products (a catalog of 1,000 tools has about 3,000 phrases and 4,000 texts), done in
/// blocks of [`HUB_BLOCK`] phrases.
fn hubness(centred: &[Vec<Vec<f32>>], k: usize) -> Result<Vec<f32>, FindError> {
    let dims = centred.iter().flatten().next().map_or(0, Vec::len);
    // Every text as a row, and where each document's texts start.
    let mut rows: Vec<f32> = Vec::new();
    let mut starts = Vec::with_capacity(centred.len() + 1);
    let mut phrases: Vec<(usize, usize)> = Vec::new(); // (owner, row)
    let mut count = 0;
    for (doc, texts) in centred.iter().enumerate() {
        starts.push(count);
        for (j, t) in texts.iter().enumerate() {
            rows.extend_from_slice(t);
            if j > 0 {
                phrases.push((doc, count));
            }
            count += 1;
        }
    }
    starts.push(count);
    let device = Device::Cpu;
    let all = Tensor::from_vec(rows.clone(), (count, dims), &device)?;
    let all_t = all.t()?.contiguous()?;
    let mut best: Vec<Vec<f32>> = vec![Vec::new(); centred.len()];
    for block in phrases.chunks(HUB_BLOCK) {
        let mut q = Vec::with_capacity(block.len() * dims);
        for &(_, row) in block {
            q.extend_from_slice(&rows[row * dims..(row + 1) * dims]);
        }
        let q = Tensor::from_vec(q, (block.len(), dims), &device)?;
        let sims = q.matmul(&all_t)?.to_vec2::<f32>()?;
        for (&(owner, _), sims) in block.iter().zip(&sims) {
            for doc in 0..centred.len() {
                if doc == owner {
                    continue;
                }
                let texts = &sims[starts[doc]..starts[doc + 1]];
                best[doc].push(combine_sims(texts));
            }
        }
    }
    Ok(best
        .into_iter()
        .map(|mut scores| {
            let k = k.min(scores.len());
            if k == 0 {
                return 0.0;
            }
            scores.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            scores[..k].iter().sum::<f32>() / k as f32
        })
        .collect())
}

/// The score of a document from the similarities of its texts (summary first): half the
/// summary's, half the best keyword's; the summary's alone when there are no keywords.
fn combine_sims(sims: &[f32]) -> f32 {
    match sims.split_first() {
        None => 0.0,
        Some((&summary, [])) => summary,
        Some((&summary, keywords)) => {
            0.5 * summary + 0.5 * keywords.iter().copied().fold(f32::MIN, f32::max)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Arc<[f32]> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn cosine_in_lanes_is_the_plain_dot_product() {
        for len in [0, 5, 8, 19, 384] {
            let a: Vec<f32> = (0..len).map(|i| (i % 7) as f32 / 7.0 - 0.4).collect();
            let b: Vec<f32> = (0..len).map(|i| (i % 5) as f32 / 5.0 - 0.3).collect();
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((cosine(&a, &b) - plain).abs() < 1e-4, "{len}");
        }
    }

    #[test]
    fn a_small_catalog_is_neither_centred_nor_penalised() {
        let docs = vec![vec![unit(&[1.0, 0.0]), unit(&[1.0, 1.0])]];
        let s = Semantic::build(
            &docs,
            &Correction {
                hub_weight: 0.25,
                hub_neighbours: 50,
            },
        )
        .unwrap();
        let q = [1.0, 0.0];
        let scores = s.scores(&q)[0];
        assert_eq!(scores.ranked, scores.plain);
        assert!((scores.plain - (0.5 + 0.5 * 0.5f32.sqrt())).abs() < 0.01);
    }

    #[test]
    fn centred_scores_from_one_product_match_centring_each_vector() {
        // 20 documents of a summary and two keywords in 24 dimensions, pseudo-random.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 1000) as f32 / 1000.0 - 0.3
        };
        let docs: Vec<DocVectors> = (0..20)
            .map(|_| {
                (0..3)
                    .map(|_| unit(&(0..24).map(|_| next()).collect::<Vec<_>>()))
                    .collect()
            })
            .collect();
        let s = Semantic::build(
            &docs,
            &Correction {
                hub_weight: 0.25,
                hub_neighbours: 5,
            },
        )
        .unwrap();
        let mean = &s.centre.as_ref().unwrap().mean;
        let query = unit(&(0..24).map(|_| next()).collect::<Vec<_>>());
        let centred_query = centre_vector(&query, mean);
        for (i, (doc, got)) in docs.iter().zip(s.scores(&query)).enumerate() {
            let sims = |q: &[f32], centred: bool| -> Vec<f32> {
                doc.iter()
                    .map(|d| {
                        let d = if centred {
                            centre_vector(d, mean)
                        } else {
                            d.to_vec()
                        };
                        cosine(q, &d)
                    })
                    .collect()
            };
            let ranked = combine_sims(&sims(&centred_query, true)) - s.penalty[i];
            let plain = combine_sims(&sims(&query, false));
            // The vectors are stored on 8 bits: a few thousandths of difference.
            assert!(
                (got.ranked - ranked).abs() < 0.02,
                "{i}: {} vs {ranked}",
                got.ranked
            );
            assert!(
                (got.plain - plain).abs() < 0.01,
                "{i}: {} vs {plain}",
                got.plain
            );
        }
        assert!(Semantic::default().scores(&query).is_empty());
    }

    #[test]
    fn the_generic_tool_is_penalised_more() {
        // 20 tools along their own axis, each with a keyword near it; tool 0's keyword sits
        // between the axes of tools 1 to 5, so it is close to their keywords.
        let dims = 20;
        let axis = |i: usize, w: f32| {
            let mut v = vec![0.1; dims];
            v[i] += w;
            v
        };
        let mut docs = Vec::new();
        for i in 0..dims {
            let keyword = if i == 0 {
                (1..=5).fold(vec![0.1; dims], |mut v, j| {
                    v[j] += 1.0;
                    v
                })
            } else {
                axis(i, 1.0)
            };
            docs.push(vec![unit(&axis(i, 2.0)), unit(&keyword)]);
        }
        let s = Semantic::build(
            &docs,
            &Correction {
                hub_weight: 0.5,
                hub_neighbours: 5,
            },
        )
        .unwrap();
        assert!(s.centre.is_some());
        assert!(
            s.penalty[1..].iter().all(|&p| p < s.penalty[0]),
            "{:?}",
            s.penalty
        );
        assert_eq!(combine_sims(&[0.2, 0.4, 0.8]), 0.5 * 0.2 + 0.5 * 0.8);
        assert_eq!(combine_sims(&[0.3]), 0.3);
    }
}
